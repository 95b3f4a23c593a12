"""Publishing a job's schedule versions (the base of the job service, api/jobs.py): a schedule picked
for a scenario (the precomputed plan of its key, relabelled, else a greedy solve in the `events` pool),
the next version committed to the store in one transaction with the job's new scenario/state and the
event that caused it (and only then published in memory, waking the job's long-polls), and the CP-SAT
refinement in the background that publishes a better plan for a scenario that is still current.
Every method runs with the job's lock held (but `_refine`, which takes it). The job's lock is `locked()`:
its asyncio lock and, on a store shared by several replicas (PostgreSQL), its database lock as well,
with the job re-read from the database first (`refresh()`: another replica may have changed it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pydantic_core

from api.job_runtime import JobRuntime, Plan, Worker, all_done, event_result
from api.metrics import Metrics
from api.restore import joined_after
from api.settings import Settings
from api.solve_partition import own_partition, plan_key, schedule_partition, solve_mode
from api.solver import Solver, raise_error, relabel_canonical
from api.store import (
    EventRecord,
    PlanRecord,
    Store,
    StoreUnavailableError,
    VersionConflictError,
    VersionRecord,
)
from api.store_coord import Coordinator, LocalCoordinator
from api.views import VersionView
from planner.contract import FailureScenario
from planner.normalize import normalize

log = logging.getLogger("api.jobs")  # the job service's one logger (log filters keep working)


class VersionPublisher:
    """Plans, commits and refines schedule versions of jobs (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        solver: Solver,
        metrics: Metrics,
        coord: Coordinator | None = None,
    ) -> None:
        self.settings, self.store, self.solver, self.metrics = settings, store, solver, metrics
        self.coord: Coordinator = coord or LocalCoordinator()
        self._tasks: set[asyncio.Task[None]] = set()  # refinements (kept referenced until done)

    @contextlib.asynccontextmanager
    async def locked(self, rt: JobRuntime) -> AsyncIterator[None]:
        """Hold the job's lock (see the module docstring); on a shared store the job is fresh inside."""
        async with rt.lock, self.coord.job_lock(rt.record.id):
            if self.coord.shared:
                self.refresh(rt)
            yield

    def refresh(self, rt: JobRuntime) -> None:
        """Re-read the job from the store (another replica may have changed it): its record in place
        (references to it stay valid), scenario, done set and, when the version moved, the published
        view; parked long-polls are woken when the version or the heartbeat switches changed."""
        rec = self.store.get_job(rt.record.id)
        if rec is None:
            return
        old = rt.record
        moved = rec.version != old.version or (rt.view is None and rec.version > 0)
        wake = moved or (rec.heartbeat_enabled, rec.heartbeat_timeout_s) != (
            old.heartbeat_enabled,
            old.heartbeat_timeout_s,
        )
        if rec.scenario_json != old.scenario_json:
            before = {(int(d), int(s)) for d, s in rt.scenario.failed}
            rt.scenario = FailureScenario.model_validate_json(rec.scenario_json)
            rt.scenario_seq += 1
            for w in before ^ {(int(d), int(s)) for d, s in rt.scenario.failed}:
                rt.last_seen.pop(w, None)
        for f in dataclasses.fields(rec):
            setattr(old, f.name, getattr(rec, f.name))
        rt.done = {(int(d), int(s)) for d, s in rec.done_workers}
        if moved:
            ver = self.store.get_version(rec.id, rec.version)
            if ver is not None:
                rt.view = self._view(rt, ver)
        if wake:
            self._wake(rt)

    async def stop(self) -> None:
        """Cancel pending refinements (at shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @staticmethod
    def _wake(rt: JobRuntime) -> None:
        """Wake every long-poll of the job (each re-checks its version and its wait)."""
        rt.changed.set()
        rt.changed = asyncio.Event()

    def _result(self, rt: JobRuntime, event_id: str, version: int, changed: bool) -> dict[str, object]:
        source = None if rt.view is None else rt.view.source
        rec = rt.record
        result = event_result(
            rec.id, event_id, version, rec.state, source, rt.scenario, rec.unrecoverable_stages
        )
        return {**result, "changed": changed}

    async def _install(self, rt: JobRuntime, scenario: FailureScenario, event: EventRecord | None) -> None:
        """Pick a schedule for `scenario` and publish it as the next version (lock held by caller)."""
        self._publish(rt, scenario, await self._plan(rt, scenario), event)

    def _publish(
        self, rt: JobRuntime, scenario: FailureScenario, plan: Plan, event: EventRecord | None
    ) -> None:
        """Commit `plan` as the next version for `scenario` and refine it in the background (lock held)."""
        self._commit_version(rt, scenario, [], plan.json, plan.source, plan.itime, event, plan.schedule)
        self._start_refine(rt, scenario, plan)

    def _start_refine(self, rt: JobRuntime, scenario: FailureScenario, plan: Plan) -> None:
        """CP-SAT in the background for a plan that is not refined yet (a re-partitioned one on the
        partition it published: api/solve_partition.py)."""
        if plan.refine:
            part = schedule_partition(plan.json, plan.schedule) if rt.record.repartition else None
            task = asyncio.get_running_loop().create_task(self._refine(rt, scenario, rt.scenario_seq, part))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _plan(self, rt: JobRuntime, scenario: FailureScenario) -> Plan:
        """A schedule for `scenario`: its stored plan relabelled, else a greedy solve (events pool)."""
        norm = normalize(rt.job, scenario)
        plan = self.store.get_plan(plan_key(norm.key, rt.record.repartition))
        schedule: dict[str, Any] | None = None
        if plan is not None:
            self.metrics.cache.labels(result="hit").inc()
            schedule = relabel_canonical(plan.schedule_json, norm, scenario)
            schedule_json = pydantic_core.to_json(schedule).decode()  # ~4x faster than json.dumps
            source, itime = "precomputed", plan.iteration_time_ms
            refine = plan.source == "greedy"
        else:
            self.metrics.cache.labels(result="miss").inc()
            t0 = time.perf_counter()
            args = (rt.record.spec_json, scenario.model_dump_json(), 1.0, False, *solve_mode(rt.record))
            out = await self.solver.run(self.solver.events, *args)
            self.metrics.solve_seconds.labels(purpose="event").observe(time.perf_counter() - t0)
            self.metrics.solves.labels(purpose="event", source=out.source or "error").inc()
            raise_error(out)
            self.store.put_plan(PlanRecord(out.key, out.canonical_json, "greedy", out.iteration_time_ms))
            schedule_json, source, itime, refine = out.physical_json, "greedy", out.iteration_time_ms, True
        return Plan(schedule_json, source, itime, refine, schedule)

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
        cause: str | None = None,
        restore: dict[str, Any] | None = None,
        answer: dict[str, Any] | None = None,
    ) -> None:
        """Write the next version, the job's new scenario/state and the event that caused it in one
        transaction; only then update the in-memory job and wake its long-polls.

        `schedule` is `schedule_json` already parsed, when the caller has it (saves a parse). `done`
        is the new set of done workers (default: unchanged); a failed worker is never done. The state
        is needs_restore with lost stages, finished when every alive worker is done, else running.
        `changed` is the answer's field (False for a `done` event: the failure set stays). `cause`: the
        version's cause when no event is written with it; `restore`: this is a restore version (every
        worker joins anew); `answer`: extra fields of the event's answer."""
        rec = rt.record
        failed = {(int(d), int(s)) for d, s in scenario.failed}
        done = {w for w in (rt.done if done is None else done) if w not in failed}
        if restore is not None:
            done = set()  # every worker restarts its iterations from the checkpoint
        if lost_stages:
            state = "needs_restore"
            done = set()  # a restore restarts every worker: each reports done again when it finishes
        else:
            state = "finished" if all_done(rt.job, failed, done) else "running"
        done_json = [list(w) for w in sorted(done)]
        scenario_json = scenario.model_dump_json()
        cause = cause if event is None else event.event_id
        ver = VersionRecord(
            rec.id, rec.version + 1, scenario_json, schedule_json, source, itime, cause, time.time()
        )
        if event is not None:
            result = event_result(rec.id, event.event_id, ver.version, state, source, scenario, lost_stages)
            event.result_json = json.dumps({**result, "changed": changed, **(answer or {})})
        update: dict[str, Any] = {
            "state": state,
            "unrecoverable_stages": lost_stages,
            "scenario_json": scenario_json,
            "done_workers": done_json,
        }
        before = {(int(d), int(s)) for d, s in rt.scenario.failed}
        joined = joined_after(rec.joined, before, failed, ver.version, restore is not None)
        if joined != rec.joined:
            update["joined"] = joined
        if restore is not None:
            update["restore"] = restore
        self.store.apply(rec.id, update, version=ver, event=event)
        rec.joined = joined
        if restore is not None:
            rec.restore = restore
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
        rt.view = self._make_view(rt, ver.version, state, source, doc)
        self.metrics.versions.inc()
        self._wake(rt)

    @staticmethod
    def _make_view(rt: JobRuntime, version: int, state: str, source: str, doc: dict[str, Any]) -> VersionView:
        rec = rt.record
        return VersionView(
            rec.id, version, state, source, doc, restore_policy=rec.restore_policy, restore=rec.restore,
            joined=rec.joined,
        )  # fmt: skip

    def _view(self, rt: JobRuntime, ver: VersionRecord) -> VersionView:
        schedule = json.loads(ver.schedule_json)
        return self._make_view(rt, ver.version, rt.record.state, ver.source, schedule)

    async def _refine(
        self, rt: JobRuntime, scenario: FailureScenario, seq: int, partition_json: str | None = None
    ) -> None:
        """CP-SAT for the current scenario in the background; publish it if it is still current and better.

        The scenario's key is claimed first (api/store_coord.py): when another replica is planning it
        right now (its precompute), this one does not plan it again; that plan is stored for the
        next event of the key. A re-partition job refines on `partition_json` (the published plan's
        partition; None: the job's own), keeping the layer split the workers are moving to."""
        limit = self.settings.cap_time_limit(None, self.settings.refine_time_limit_s).total_seconds()
        key = plan_key(normalize(rt.job, scenario).key, rt.record.repartition)
        try:
            if not self.coord.try_claim(key):
                log.info("job %s: %s is being planned by another replica", rt.record.id, key)
                return
            try:
                t0 = time.perf_counter()
                args: tuple[object, ...] = (rt.record.spec_json, scenario.model_dump_json(), limit, True)
                if rt.record.repartition:
                    args += (True, partition_json or own_partition(rt.job))
                out = await self.solver.submit_background(0, *args)
            finally:
                self.coord.release_claim(key)
            self.metrics.solve_seconds.labels(purpose="refine").observe(time.perf_counter() - t0)
            self.metrics.solves.labels(purpose="refine", source=out.source or "error").inc()
        except StoreUnavailableError as exc:
            log.warning("job %s: refinement skipped: %s", rt.record.id, exc)
            return
        except Exception:
            log.exception("job %s: refinement failed", rt.record.id)
            return
        if out.error is not None:
            return
        try:
            self.store.put_plan(PlanRecord(out.key, out.canonical_json, "refined", out.iteration_time_ms))
            await self._publish_refined(rt, scenario, seq, out)
        except (StoreUnavailableError, VersionConflictError) as exc:
            log.warning("job %s: refinement not published: %s", rt.record.id, exc)

    async def _publish_refined(self, rt: JobRuntime, scenario: FailureScenario, seq: int, out: Any) -> None:
        async with self.locked(rt):
            current = rt.view
            if rt.scenario_seq != seq or current is None or rt.record.state == "finished":
                return
            if out.iteration_time_ms < current.schedule["iteration_time_ms"] - 1e-9:
                self._commit_version(
                    rt, scenario, [], out.physical_json, out.source, out.iteration_time_ms, None
                )
