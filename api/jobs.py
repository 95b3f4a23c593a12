"""The job service: registered jobs, their failure sets, and the versioned schedules workers poll.

Every change to a job (creation, an event, a heartbeat failure, a better CP-SAT plan) runs under
that job's asyncio lock and is written to the store in one transaction before it is published, so
concurrent events serialize into consecutive versions and a restart never shows an older version.
Schedules come from the precomputed plan of the scenario's key when there is one, otherwise from a
greedy solve in the `events` pool, followed by a CP-SAT refinement in the background.

The service is layered: api/versions.py plans, commits and refines versions; api/job_events.py applies
each event kind; this module holds the registry (jobs, tokens, creation, switches, start-up). On a
store shared by several replicas (PostgreSQL) a job or token this process does not know yet is read
from the store on first use, and api/job_sync.py follows the other replicas' changes.

A job is `running`, `needs_restore` (a whole stage lost) or `finished`: every alive worker posted a
`done` event (it completed its iterations and stops polling). A finished job takes no more events
(but `checkpoint` reports, which change nothing). With restore policy `auto` (the default), an event
that loses a whole stage commits the `needs_restore` version and at once a restore version: every
worker alive, `restore` = {epoch, iteration} (api/restore.py).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from api.errors import JobNotFoundError
from api.idempotency import new_record
from api.job_events import JobEvents
from api.job_runtime import (
    POLL_WAIT_FRACTION,
    JobRuntime,
    Plan,
    all_done,
    event_result,
    hash_token,
)
from api.metrics import Metrics
from api.models import EventIn, JobCreate, JobCreated
from api.rules import check_dimensions
from api.settings import Settings
from api.solve_partition import check_repartition
from api.solver import Solver
from api.store import JobRecord, Store
from api.store_coord import Coordinator
from planner.contract import FailureScenario, JobSpec
from planner.contract_fields import unread_fields
from planner.errors import InvalidInputError

__all__ = ["POLL_WAIT_FRACTION", "JobRuntime", "JobService", "Plan", "all_done", "event_result", "hash_token"]


class JobService(JobEvents):
    """Jobs, events and schedule versions; the routes are thin wrappers around these methods."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        solver: Solver,
        metrics: Metrics,
        coord: Coordinator | None = None,
    ) -> None:
        super().__init__(settings, store, solver, metrics, coord)
        self.jobs: dict[str, JobRuntime] = {}
        self._token_jobs: dict[str, str] = {}  # worker token hash -> job id (every poll authenticates)
        self.on_new_job: Callable[[JobRuntime], None] | None = None  # a job another replica registered
        self.stopping = False  # begin_stop: shutting down

    def begin_stop(self) -> None:
        """A shutdown starts (api/cli.py): no more heartbeat failures (workers cannot reach a stopping
        service, which is no sign of their death) and every parked long-poll ends now with a 304 (the
        server waits for open connections before it stops; a poll parked for its full wait kept the
        heartbeat checks running that long and failed healthy workers)."""
        self.stopping = True
        for rt in self.jobs.values():
            rt.closing = True
            self._wake(rt)

    def load(self) -> list[JobRuntime]:
        """Read every job and its latest version from the store (at start-up). Every alive worker of a
        running job counts as seen at start-up + RECYCLE_RESTORE_GRACE_S, as after a restore: one that
        died while the service was down is declared failed once its peers poll again."""
        until = time.monotonic() + self.settings.restore_grace_s
        for rec in self.store.list_jobs():
            if rec.id not in self.jobs:  # (a replica's listener may have added it already)
                rt = self.add(rec)
                if rec.state == "running":
                    rt.expect_every_worker(until)
        return list(self.jobs.values())

    def add(self, rec: JobRecord) -> JobRuntime:
        """Hold job `rec` (read from the store) in memory, with its current version."""
        rt = JobRuntime(
            record=rec,
            job=JobSpec.model_validate_json(rec.spec_json),
            scenario=FailureScenario.model_validate_json(rec.scenario_json),
            done={(int(d), int(s)) for d, s in rec.done_workers},
        )
        latest = self.store.get_version(rec.id, rec.version) if rec.version else None
        if latest is not None:
            rt.view = self._view(rt, latest)
        self.jobs[rec.id] = rt
        self._token_jobs[rec.worker_token_hash] = rec.id
        self.metrics.jobs.set(len(self.jobs))
        return rt

    def fetch(self, job_id: str) -> JobRuntime | None:
        """The job from memory or, on a shared store, from the store (registered by another replica)."""
        rt = self.jobs.get(job_id)
        if rt is None and self.coord.shared:
            rec = self.store.get_job(job_id)
            if rec is not None:
                rt = self.add(rec)
                if self.on_new_job is not None:
                    self.on_new_job(rt)
        return rt

    def get(self, job_id: str) -> JobRuntime:
        """The job's runtime, or JobNotFoundError."""
        rt = self.fetch(job_id)
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
        """The job whose worker token this is, if any (from memory; on a shared store a token of a job
        another replica registered is looked up there)."""
        token_hash = hash_token(token)
        job_id = self._token_jobs.get(token_hash)
        if job_id is None and self.coord.shared:
            job_id = self.store.job_id_for_token_hash(token_hash)
            if job_id is not None and self.fetch(job_id) is None:
                job_id = None
        return job_id

    async def create(self, req: JobCreate, idempotency_key: str | None = None) -> tuple[JobRuntime, str]:
        """Register a job, publish version 1 (failure-free plan); returns the runtime and worker token.
        The plan comes first: a job it refuses (no schedule fits its memory) or that the solver cannot
        plan in time is not stored, so neither the job nor its Idempotency-Key is left behind.

        With `idempotency_key` (checked and not yet used: see api/idempotency.py), the key and the
        answer are stored in the job's own transaction."""
        check_dimensions(req.job, self.settings)
        if req.max_failures > self.settings.max_failures_cap:
            raise InvalidInputError(
                f"max_failures: {req.max_failures} is above the limit {self.settings.max_failures_cap}"
            )
        if req.repartition:
            check_repartition(req.job)  # 422 naming `layers` when it has no per-layer figures
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
            restore_policy=req.restore_policy,
            repartition=req.repartition,
        )
        idem = None
        if idempotency_key is not None:
            warnings = unread_fields(req.job, "job.")
            answer = JobCreated(id=rec.id, worker_token=token, version=1, state="running", warnings=warnings)
            idem = new_record(idempotency_key, req, answer)
        new = JobRuntime(record=rec, job=req.job, scenario=FailureScenario())
        plan = await self._plan(new, new.scenario)  # before storing: a job no schedule fits leaves nothing
        self.store.create_job(rec, idem)
        rt = self.jobs.get(rec.id)  # the listener may have added it already (its NOTIFY)
        if rt is None:
            rt = new
            self.jobs[rec.id] = rt
            self._token_jobs[rec.worker_token_hash] = rec.id
            self.metrics.jobs.set(len(self.jobs))
        async with self.locked(rt):
            self._publish(rt, rt.scenario, plan, event=None)
        return rt, token

    async def ensure_version(self, rt: JobRuntime) -> None:
        """Publish a plan for a job that has none (it crashed between creation and its first version),
        and the restore version of an auto-restore job left `needs_restore` (it crashed between the two
        versions of a restore)."""
        async with self.locked(rt):
            if rt.view is None and rt.record.state == "running":
                await self._install(rt, rt.scenario, event=None)
            elif rt.record.state == "needs_restore" and rt.record.restore_policy == "auto":
                await self._restore(rt, list(rt.record.unrecoverable_stages), None, "restore-after-restart")

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

    async def apply_event(
        self, job_id: str, event: EventIn, still_silent: bool = False
    ) -> tuple[dict[str, object], list[int]]:
        """Apply `event` once; a replay returns the first answer. Returns (result, unrecoverable stages).

        A finished job takes no event (JobFinishedError) except a replay, or a `done` of workers that
        are done already (answered as a no-op, so a worker that retries gets the same answer).
        `still_silent` (the heartbeat loop's `fail`, decided before taking the lock): workers that
        reported `done` or polled again meanwhile are left out."""
        rt = self.get(job_id)
        async with self.locked(rt):
            if still_silent:
                failed = {(int(d), int(s)) for d, s in rt.scenario.failed}  # (another replica's, maybe)
                silent = [
                    w
                    for w in event.workers
                    if (w[0], w[1]) not in rt.done | failed and (w[0], w[1]) not in rt.last_seen
                ]
                if silent and self.coord.shared:  # the claim: under the job's lock, seen anywhere?
                    ws = [(w[0], w[1]) for w in silent]
                    seen = self.coord.seen_within(job_id, ws, self.heartbeat_timeout(rt))
                    silent = [w for w in silent if (w[0], w[1]) not in seen]
                if not silent:
                    return self._result(rt, event.event_id, rt.version, changed=False), []
                event = event.model_copy(update={"workers": silent})
            return await self._apply_locked(rt, job_id, event)
