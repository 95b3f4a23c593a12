"""Applying one event to a job (api/jobs.py's JobService, with the job's lock held): `fail` / `rejoin` /
`slow` change the failure scenario and publish its schedule; `done` records finished workers (the job
turns `finished` once every alive worker is done); `checkpoint` records a stage's checkpoint (no
version); an event that loses a whole stage commits the `needs_restore` version and, under restore
policy `auto`, at once the restore version: every worker alive, `restore` = {epoch, iteration}
(api/restore.py). A replayed event_id gets its first answer.
"""

from __future__ import annotations

import json
import logging
import time

import pydantic_core

from api.errors import EventConflictError, JobFinishedError, WorkerFailedError
from api.job_runtime import JobRuntime, Plan, Worker, all_done
from api.models import EventIn
from api.restore import add_checkpoint, restorable_iteration
from api.rules import apply_change
from api.store import EventRecord
from api.versions import VersionPublisher
from planner.contract import FailureScenario
from planner.errors import UnrecoverableScenarioError

log = logging.getLogger("api.jobs")  # the job service's one logger (log filters keep working)


class JobEvents(VersionPublisher):
    """The event kinds of the job service (see the module docstring)."""

    async def _apply_locked(
        self, rt: JobRuntime, job_id: str, event: EventIn
    ) -> tuple[dict[str, object], list[int]]:
        """apply_event with the job's lock held."""
        body = event.body_json()
        old = self.store.get_event(job_id, event.event_id)
        if old is not None:
            if old.body_json != body:
                raise EventConflictError(f"event_id {event.event_id!r} was used before with another body")
            result = json.loads(old.result_json)
            if self._auto(rt) and rt.record.state == "needs_restore" and result.get("version") == rt.version:
                # its needs_restore version is the job's latest: the process that wrote it died before
                # the restore version (a replica killed mid-event); the retry completes the restore
                rec = EventRecord(job_id, old.event_id, old.seq, body, 200, "", old.created_at)
                await self._restore(rt, list(rt.record.unrecoverable_stages), rec, rec.event_id)
                result = json.loads(rec.result_json)
            result["replayed"] = True
            lost = result.get("unrecoverable_stages") if old.status_code == 409 else None
            return result, list(lost or [])
        scenario = apply_change(rt.scenario, event, rt.job)
        rec = EventRecord(job_id, event.event_id, time.time_ns(), body, 200, "", time.time())
        targets = {(int(d), int(s)) for d, s in event.workers}
        finished = rt.record.state == "finished"
        if finished and event.kind != "checkpoint" and not (event.kind == "done" and targets <= rt.done):
            raise JobFinishedError(
                f"job {job_id} is finished (every alive worker reported done): it takes no more events"
            )
        if event.kind == "done":
            self._done(rt, targets, rec)
            return json.loads(rec.result_json), []
        if event.kind == "checkpoint":
            assert event.iteration is not None
            self._checkpoint(rt, targets, event.iteration, rec)
            return json.loads(rec.result_json), []
        if scenario == rt.scenario and rt.record.state == "needs_restore" and self._auto(rt):
            await self._restore(rt, list(rt.record.unrecoverable_stages), rec, rec.event_id)
            return json.loads(rec.result_json), []
        if scenario == rt.scenario:
            result = self._result(rt, event.event_id, rt.version, changed=False)
            rec.status_code = 409 if rt.record.unrecoverable_stages else 200
            rec.result_json = json.dumps(result)
            self.store.apply(job_id, {}, event=rec)
            return result, list(rt.record.unrecoverable_stages)
        try:
            scenario.check_against(rt.job)
        except UnrecoverableScenarioError as exc:
            assert rt.view is not None
            prev = rt.view.schedule
            itime = prev["iteration_time_ms"]
            prev_json = pydantic_core.to_json(prev).decode()
            if self._auto(rt):  # needs_restore, then at once the restore version: the event succeeded
                restored = FailureScenario(slow=scenario.slow)
                plan = await self._plan(rt, restored)  # before committing: both versions back to back
                # The event is written with the first version, its answer completed with the second: a
                # crash between them (the restart finishes the restore) leaves the event applied once,
                # and the client's retry is a replay, not a second failure of the restored workers.
                self._commit_version(rt, scenario, exc.stages, prev_json, "needs_restore", itime, rec, prev)
                await self._restore(rt, exc.stages, rec, rec.event_id, plan)
                return json.loads(rec.result_json), []
            rec.status_code = 409
            self._commit_version(rt, scenario, exc.stages, prev_json, "needs_restore", itime, rec, prev)
            return json.loads(rec.result_json), exc.stages
        await self._install(rt, scenario, event=rec)
        return json.loads(rec.result_json), []

    @staticmethod
    def _auto(rt: JobRuntime) -> bool:
        return rt.record.restore_policy == "auto"

    async def _restore(
        self,
        rt: JobRuntime,
        lost_stages: list[int],
        rec: EventRecord | None,
        cause: str,
        plan: Plan | None = None,
    ) -> None:
        """Commit the restore version after a needs_restore one (lock held): every worker alive (slow
        marks kept), `restore` = {previous epoch + 1, the newest iteration every stage reported a
        checkpoint for (None: initial parameters)}; every worker counts as seen now + the restore grace
        (RECYCLE_RESTORE_GRACE_S) so that a restarted one has time to start and poll; until one of them
        polls, none is declared failed (api/background.py). `rec`'s answer describes both versions
        (status 200)."""
        needs_restore_version = rt.version
        restored = FailureScenario(slow=rt.scenario.slow)
        if plan is None:
            plan = await self._plan(rt, restored)
        epoch = 1 + int((rt.record.restore or {}).get("epoch", 0))
        iteration = restorable_iteration(rt.record.checkpoints, rt.job.num_stages)
        restore = {"epoch": epoch, "iteration": iteration}
        extra = {
            "unrecoverable_stages": lost_stages,
            "needs_restore_version": needs_restore_version,
            "restore": restore,
        }
        if rec is not None:
            rec.status_code = 200
        self._commit_version(
            rt, restored, [], plan.json, plan.source, plan.itime, rec, plan.schedule, cause=cause,
            restore=restore, answer=extra,
        )  # fmt: skip
        until = time.monotonic() + self.settings.restore_grace_s
        rt.expect_every_worker(until)
        log.warning(
            "job %s: stages %s lost; restored as v%d (epoch %d, checkpoint %s)",
            rt.record.id, lost_stages, rt.version, epoch, restore["iteration"],
        )  # fmt: skip
        self._start_refine(rt, restored, plan)

    @staticmethod
    def _refuse_failed(rt: JobRuntime, targets: set[Worker], what: str) -> set[Worker]:
        """The job's failed workers; WorkerFailedError when some of `targets` are among them (`what`
        they report does not count)."""
        failed = {(int(d), int(s)) for d, s in rt.scenario.failed}
        if targets & failed:
            bad = [list(w) for w in sorted(targets & failed)]
            raise WorkerFailedError(
                f"workers {bad} are failed in version {rt.version}: {what} does not count"
            )
        return failed

    def _checkpoint(self, rt: JobRuntime, targets: set[Worker], iteration: int, rec: EventRecord) -> None:
        """Record a checkpoint report (lock held): no version; a failed worker's report does not count."""
        self._refuse_failed(rt, targets, "their checkpoint")
        checkpoints = add_checkpoint(rt.record.checkpoints, sorted({s for _, s in targets}), iteration)
        result = self._result(rt, rec.event_id, rt.version, changed=False)
        result["restorable_iteration"] = restorable_iteration(checkpoints, rt.job.num_stages)
        rec.result_json = json.dumps(result)
        self.store.apply(rt.record.id, {"checkpoints": checkpoints}, event=rec)
        rt.record.checkpoints = checkpoints

    def _done(self, rt: JobRuntime, targets: set[Worker], rec: EventRecord) -> None:
        """Record `targets` as done (lock held): no longer tracked by heartbeats; when every alive
        worker is done, the job turns `finished` in a new version (same schedule) that pollers see."""
        failed = self._refuse_failed(rt, targets, "their work")
        done = rt.done | targets
        if rt.record.state == "running" and all_done(rt.job, failed, done):
            assert rt.view is not None
            prev = rt.view.schedule
            prev_json = pydantic_core.to_json(prev).decode()
            itime = prev["iteration_time_ms"]
            self._commit_version(
                rt, rt.scenario, [], prev_json, rt.view.source, itime, rec, prev, done=done, changed=False
            )
        else:
            rec.result_json = json.dumps(self._result(rt, rec.event_id, rt.version, changed=False))
            done_json = [list(w) for w in sorted(done)]
            self.store.apply(rt.record.id, {"done_workers": done_json}, event=rec)
            rt.done, rt.record.done_workers = done, done_json
        for w in targets:
            rt.last_seen.pop(w, None)
