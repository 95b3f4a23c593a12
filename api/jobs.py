"""The job service: registered jobs, their failure sets, and the versioned schedules workers poll.

Every change to a job (creation, an event, a heartbeat failure, a better CP-SAT plan) runs under
that job's asyncio lock and is written to the store in one transaction before it is published, so
concurrent events serialize into consecutive versions and a restart never shows an older version.
Schedules come from the precomputed plan of the scenario's key when there is one, otherwise from a
greedy solve in the `events` pool, followed by a CP-SAT refinement in the background.

A job is `running`, `needs_restore` (a whole stage lost) or `finished`: every alive worker posted a
`done` event (it completed its iterations and stops polling). A finished job takes no more events.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import pydantic_core

from api.errors import EventConflictError, JobFinishedError, JobNotFoundError, WorkerFailedError
from api.idempotency import new_record
from api.metrics import Metrics
from api.models import EventIn, JobCreate, JobCreated
from api.rules import apply_change, check_dimensions
from api.settings import Settings
from api.solver import Solver, raise_error, relabel_canonical
from api.store import EventRecord, JobRecord, PlanRecord, Store, VersionRecord
from api.views import VersionView
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError, UnrecoverableScenarioError
from planner.normalize import normalize

log = logging.getLogger(__name__)

Worker = tuple[int, int]

# A heartbeat poll (the job's worker token, `worker=d,s`) waits at most this fraction of the job's
# heartbeat timeout, so a healthy worker's next poll arrives well within the timeout: liveness comes
# only from requests arriving, never from a poll left parked on an open socket.
POLL_WAIT_FRACTION = 1 / 3


def hash_token(token: str) -> str:
    """What the store keeps of a worker token."""
    return hashlib.sha256(token.encode()).hexdigest()


def event_result(
    job_id: str, event_id: str, version: int, state: str, source: str | None, scenario: FailureScenario,
    lost_stages: list[int],
) -> dict[str, object]:  # fmt: skip
    """The answer to an event (`changed` False: the caller sets it when the event made a version)."""
    result: dict[str, object] = {
        "event_id": event_id, "job_id": job_id, "version": version, "state": state, "source": source,
        "failed": [list(w) for w in scenario.failed], "changed": False, "replayed": False,
    }  # fmt: skip
    if lost_stages:
        result["unrecoverable_stages"] = lost_stages
    return result


def all_done(job: JobSpec, failed: set[Worker], done: set[Worker]) -> bool:
    """True when every alive worker of `job` (not in `failed`) is in `done`, and some worker is alive."""
    alive = job.num_pipelines * job.num_stages - len(failed)
    return alive > 0 and len(done - failed) == alive


@dataclass
class JobRuntime:
    """In-memory state of one job; the store is the source of truth, this is its published view."""

    record: JobRecord
    job: JobSpec
    scenario: FailureScenario
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    view: VersionView | None = None
    scenario_seq: int = 0
    last_seen: dict[Worker, float] = field(default_factory=dict)  # arrival of each worker's last poll
    done: set[Worker] = field(default_factory=set)  # alive workers that reported `done`

    @property
    def version(self) -> int:
        return self.record.version


class JobService:
    """Jobs, events and schedule versions; the routes are thin wrappers around these methods."""

    def __init__(self, settings: Settings, store: Store, solver: Solver, metrics: Metrics) -> None:
        self.settings, self.store, self.solver, self.metrics = settings, store, solver, metrics
        self.jobs: dict[str, JobRuntime] = {}
        self._token_jobs: dict[str, str] = {}  # worker token hash -> job id (every poll authenticates)
        self._tasks: set[asyncio.Task[None]] = set()  # refinements (kept referenced until done)

    def load(self) -> list[JobRuntime]:
        """Read every job and its latest version from the store (at start-up)."""
        for rec in self.store.list_jobs():
            rt = JobRuntime(
                record=rec,
                job=JobSpec.model_validate_json(rec.spec_json),
                scenario=FailureScenario.model_validate_json(rec.scenario_json),
                done={(int(d), int(s)) for d, s in rec.done_workers},
            )
            latest = self.store.latest_version(rec.id)
            if latest is not None:
                rt.view = self._view(rt, latest)
            self.jobs[rec.id] = rt
            self._token_jobs[rec.worker_token_hash] = rec.id
        self.metrics.jobs.set(len(self.jobs))
        return list(self.jobs.values())

    async def stop(self) -> None:
        """Cancel pending refinements (at shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def get(self, job_id: str) -> JobRuntime:
        """The job's runtime, or JobNotFoundError."""
        rt = self.jobs.get(job_id)
        if rt is None:
            raise JobNotFoundError(job_id)
        return rt

    def heartbeat_timeout(self, rt: JobRuntime) -> float:
        """The job's heartbeat timeout in seconds (its own, else the service's default)."""
        return rt.record.heartbeat_timeout_s or self.settings.heartbeat_timeout_s

    def poll_wait_cap(self, rt: JobRuntime) -> float:
        """The longest wait a heartbeat poll of this job is granted: RECYCLE_MAX_WAIT_S, and a third of
        the heartbeat timeout while heartbeats are on (a healthy worker re-polls well within it)."""
        cap = self.settings.max_wait_s
        if rt.record.heartbeat_enabled:
            cap = min(cap, self.heartbeat_timeout(rt) * POLL_WAIT_FRACTION)
        return cap

    def job_id_for_token(self, token: str) -> str | None:
        """The job whose worker token this is, if any (from memory: every job of this process is loaded)."""
        return self._token_jobs.get(hash_token(token))

    async def create(self, req: JobCreate, idempotency_key: str | None = None) -> tuple[JobRuntime, str]:
        """Register a job, publish version 1 (failure-free plan); returns the runtime and worker token.

        With `idempotency_key` (checked and not yet used: see api/idempotency.py), the key and the
        answer are stored in the job's own transaction."""
        check_dimensions(req.job, self.settings)
        if req.max_failures > self.settings.max_failures_cap:
            raise InvalidInputError(
                f"max_failures: {req.max_failures} is above the limit {self.settings.max_failures_cap}"
            )
        token = secrets.token_hex(32)  # hex: never starts with '-', which CLIs would take for a flag
        rec = JobRecord(
            id=secrets.token_hex(8),
            name=req.job.name,
            spec_json=req.job.model_dump_json(),
            worker_token_hash=hash_token(token),
            created_at=time.time(),
            max_failures=req.max_failures,
            heartbeat_enabled=req.heartbeat_enabled,
            heartbeat_timeout_s=req.heartbeat_timeout_s,
        )
        idem = None
        if idempotency_key is not None:
            answer = JobCreated(id=rec.id, worker_token=token, version=1, state="running")
            idem = new_record(idempotency_key, req, answer)
        self.store.create_job(rec, idem)
        rt = JobRuntime(record=rec, job=req.job, scenario=FailureScenario())
        self.jobs[rec.id] = rt
        self._token_jobs[rec.worker_token_hash] = rec.id
        self.metrics.jobs.set(len(self.jobs))
        async with rt.lock:
            await self._install(rt, rt.scenario, event=None)
        return rt, token

    async def ensure_version(self, rt: JobRuntime) -> None:
        """Publish a plan for a job that has none (it crashed between creation and its first version)."""
        async with rt.lock:
            if rt.view is None and rt.record.state == "running":
                await self._install(rt, rt.scenario, event=None)

    def set_switches(self, rt: JobRuntime, enabled: bool | None, timeout_s: float | None) -> None:
        """Change the job's heartbeat switches (persisted).

        Tracking restarts under the new switches: every tracked worker counts as seen now, and the
        parked polls wake up to re-check their wait against the new cap (a shorter timeout ends them
        at once, and the workers' next polls arrive within the new cap)."""
        update: dict[str, object] = {}
        if enabled is not None:
            update["heartbeat_enabled"] = enabled
        if timeout_s is not None:
            update["heartbeat_timeout_s"] = timeout_s
        self.store.apply(rt.record.id, update)
        for k, v in update.items():
            setattr(rt.record, k, v)
        if update:
            now = time.monotonic()
            for w in rt.last_seen:
                rt.last_seen[w] = now
            self._wake(rt)

    @staticmethod
    def _wake(rt: JobRuntime) -> None:
        """Wake every long-poll of the job (each re-checks its version and its wait)."""
        rt.changed.set()
        rt.changed = asyncio.Event()

    async def apply_event(
        self, job_id: str, event: EventIn, still_silent: bool = False
    ) -> tuple[dict[str, object], list[int]]:
        """Apply `event` once; a replay returns the first answer. Returns (result, unrecoverable stages).

        A finished job takes no event (JobFinishedError) except a replay, or a `done` of workers that
        are done already (answered as a no-op, so a worker that retries gets the same answer).
        `still_silent` (the heartbeat loop's `fail`, decided before taking the lock): workers that
        reported `done` or polled again meanwhile are left out."""
        rt = self.get(job_id)
        async with rt.lock:
            if still_silent:
                silent = [
                    w
                    for w in event.workers
                    if (w[0], w[1]) not in rt.done and (w[0], w[1]) not in rt.last_seen
                ]
                if not silent:
                    return self._result(rt, event.event_id, rt.version, changed=False), []
                event = event.model_copy(update={"workers": silent})
            return await self._apply_locked(rt, job_id, event)

    async def _apply_locked(
        self, rt: JobRuntime, job_id: str, event: EventIn
    ) -> tuple[dict[str, object], list[int]]:
        """apply_event with the job's lock held."""
        body = event.model_dump_json()
        old = self.store.get_event(job_id, event.event_id)
        if old is not None:
            if old.body_json != body:
                raise EventConflictError(f"event_id {event.event_id!r} was used before with another body")
            result = json.loads(old.result_json)
            result["replayed"] = True
            return result, list(result.get("unrecoverable_stages", []))
        scenario = apply_change(rt.scenario, event, rt.job)
        rec = EventRecord(job_id, event.event_id, time.time_ns(), body, 200, "", time.time())
        targets = {(int(d), int(s)) for d, s in event.workers}
        if rt.record.state == "finished" and not (event.kind == "done" and targets <= rt.done):
            raise JobFinishedError(
                f"job {job_id} is finished (every alive worker reported done): it takes no more events"
            )
        if event.kind == "done":
            self._done(rt, targets, rec)
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
            rec.status_code = 409
            prev = rt.view.schedule
            itime = prev["iteration_time_ms"]
            prev_json = pydantic_core.to_json(prev).decode()
            self._commit_version(rt, scenario, exc.stages, prev_json, "needs_restore", itime, rec, prev)
            return json.loads(rec.result_json), exc.stages
        await self._install(rt, scenario, event=rec)
        return json.loads(rec.result_json), []

    def _done(self, rt: JobRuntime, targets: set[Worker], rec: EventRecord) -> None:
        """Record `targets` as done (lock held): no longer tracked by heartbeats; when every alive
        worker is done, the job turns `finished` in a new version (same schedule) that pollers see."""
        failed = {(int(d), int(s)) for d, s in rt.scenario.failed}
        if targets & failed:
            bad = [list(w) for w in sorted(targets & failed)]
            raise WorkerFailedError(
                f"workers {bad} are failed in version {rt.version}: their work does not count"
            )
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

    def _result(self, rt: JobRuntime, event_id: str, version: int, changed: bool) -> dict[str, object]:
        source = None if rt.view is None else rt.view.source
        rec = rt.record
        result = event_result(
            rec.id, event_id, version, rec.state, source, rt.scenario, rec.unrecoverable_stages
        )
        return {**result, "changed": changed}

    async def _install(self, rt: JobRuntime, scenario: FailureScenario, event: EventRecord | None) -> None:
        """Pick a schedule for `scenario` and publish it as the next version (lock held by caller)."""
        norm = normalize(rt.job, scenario)
        plan = self.store.get_plan(norm.key)
        schedule: dict[str, Any] | None = None
        if plan is not None:
            self.metrics.cache.inc(result="hit")
            schedule = relabel_canonical(plan.schedule_json, norm, scenario)
            schedule_json = pydantic_core.to_json(schedule).decode()  # ~4x faster than json.dumps
            source, itime = "precomputed", plan.iteration_time_ms
            refine = plan.source == "greedy"
        else:
            self.metrics.cache.inc(result="miss")
            t0 = time.perf_counter()
            out = await self.solver.run(
                self.solver.events, rt.record.spec_json, scenario.model_dump_json(), 1.0, False
            )
            self.metrics.solve_seconds.observe(time.perf_counter() - t0, purpose="event")
            self.metrics.solves.inc(purpose="event", source=out.source or "error")
            raise_error(out)
            self.store.put_plan(PlanRecord(out.key, out.canonical_json, "greedy", out.iteration_time_ms))
            schedule_json, source, itime, refine = out.physical_json, "greedy", out.iteration_time_ms, True
        self._commit_version(rt, scenario, [], schedule_json, source, itime, event, schedule)
        if refine:
            task = asyncio.get_running_loop().create_task(self._refine(rt, scenario, rt.scenario_seq))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _commit_version(
        self,
        rt: JobRuntime,
        scenario: FailureScenario,
        lost_stages: list[int],
        schedule_json: str,
        source: str,
        itime: float,
        event: EventRecord | None,
        schedule: dict[str, Any] | None = None,
        done: set[Worker] | None = None,
        changed: bool = True,
    ) -> None:
        """Write the next version, the job's new scenario/state and the event that caused it in one
        transaction; only then update the in-memory job and wake its long-polls.

        `schedule` is `schedule_json` already parsed, when the caller has it (saves a parse). `done`
        is the new set of done workers (default: unchanged); a failed worker is never done. The state
        is needs_restore with lost stages, finished when every alive worker is done, else running.
        `changed` is the answer's field (False for a `done` event: the failure set stays)."""
        rec = rt.record
        failed = {(int(d), int(s)) for d, s in scenario.failed}
        done = {w for w in (rt.done if done is None else done) if w not in failed}
        if lost_stages:
            state = "needs_restore"
            done = set()  # a restore restarts every worker: each reports done again when it finishes
        else:
            state = "finished" if all_done(rt.job, failed, done) else "running"
        done_json = [list(w) for w in sorted(done)]
        scenario_json = scenario.model_dump_json()
        cause = None if event is None else event.event_id
        ver = VersionRecord(
            rec.id, rec.version + 1, scenario_json, schedule_json, source, itime, cause, time.time()
        )
        if event is not None:
            result = event_result(rec.id, event.event_id, ver.version, state, source, scenario, lost_stages)
            event.result_json = json.dumps({**result, "changed": changed})
        update = {
            "state": state,
            "unrecoverable_stages": lost_stages,
            "scenario_json": scenario_json,
            "done_workers": done_json,
        }
        self.store.apply(rec.id, update, version=ver, event=event)
        if scenario != rt.scenario:
            rt.scenario_seq += 1
            # a failed worker is not tracked, and a re-joiner is tracked again from its first poll
            for w in failed ^ {(int(d), int(s)) for d, s in rt.scenario.failed}:
                rt.last_seen.pop(w, None)
        rt.scenario, rec.scenario_json, rec.state, rec.unrecoverable_stages = (
            scenario,
            scenario_json,
            state,
            lost_stages,
        )
        rec.version = ver.version
        rt.done, rec.done_workers = done, done_json
        doc = json.loads(schedule_json) if schedule is None else schedule
        rt.view = VersionView(rec.id, ver.version, state, source, doc)
        self.metrics.versions.inc()
        self._wake(rt)

    def _view(self, rt: JobRuntime, ver: VersionRecord) -> VersionView:
        schedule = json.loads(ver.schedule_json)
        return VersionView(rt.record.id, ver.version, rt.record.state, ver.source, schedule)

    async def _refine(self, rt: JobRuntime, scenario: FailureScenario, seq: int) -> None:
        """CP-SAT for the current scenario in the background; publish it if it is still current and better."""
        limit = self.settings.cap_time_limit(None, self.settings.refine_time_limit_s).total_seconds()
        try:
            t0 = time.perf_counter()
            args = (rt.record.spec_json, scenario.model_dump_json(), limit, True)
            out = await self.solver.submit_background(0, *args)
            self.metrics.solve_seconds.observe(time.perf_counter() - t0, purpose="refine")
            self.metrics.solves.inc(purpose="refine", source=out.source or "error")
        except Exception:
            log.exception("job %s: refinement failed", rt.record.id)
            return
        if out.error is not None:
            return
        self.store.put_plan(PlanRecord(out.key, out.canonical_json, "refined", out.iteration_time_ms))
        async with rt.lock:
            current = rt.view
            if rt.scenario_seq != seq or current is None or rt.record.state == "finished":
                return
            if out.iteration_time_ms < current.schedule["iteration_time_ms"] - 1e-9:
                self._commit_version(
                    rt, scenario, [], out.physical_json, out.source, out.iteration_time_ms, None
                )
