"""Long-running service tasks: precomputing plans per job, and failing workers that went silent."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from api.job_sync import SharedHeartbeats
from api.jobs import JobRuntime, JobService
from api.models import EventIn
from api.solve_partition import plan_key, solve_mode
from api.solver import enumerate_scenarios
from api.store import PlanRecord, StoreUnavailableError
from planner.contract import FailureScenario

log = logging.getLogger(__name__)

MAX_PRECOMPUTED_KEYS = 2000  # per job; beyond this, scenarios are planned on demand
RETRY_S = 0.5  # wait before retrying keys another replica claimed, or after the database was unreachable


async def precompute(service: JobService, rt: JobRuntime) -> None:
    """Plan (greedy + CP-SAT) every normalized scenario up to the job's max_failures, fewest first.

    Keys already in the store are skipped, so after a restart it resumes where it stopped. On a store
    shared by replicas each key is claimed first (api/store_coord.py): replicas precomputing the same
    job split the keys, and a key whose claimer died is taken over. Progress (precompute_total, the
    keys stored or given up as precompute_done) is persisted in the job record. While the database is
    unreachable it waits and resumes. As many keys are planned at once as the solver runs background
    solves (Solver.background_slots: the Ray cluster's CPUs when RECYCLE_RAY_ADDRESS is set).
    """
    while True:
        try:
            await _precompute(service, rt)
            return
        except StoreUnavailableError as exc:
            log.warning("job %s: precompute paused: %s", rt.record.id, exc)
            await asyncio.sleep(RETRY_S)


async def _precompute(service: JobService, rt: JobRuntime) -> None:
    rec = rt.record
    store, coord = service.store, service.coord
    scenarios = await asyncio.to_thread(enumerate_scenarios, rt.job, rec.max_failures, MAX_PRECOMPUTED_KEYS)
    keys = [(await asyncio.to_thread(_key, rt, sc), sc) for sc in scenarios]
    all_keys = [k for k, _ in keys]
    given_up: set[str] = set()

    def progress() -> set[str]:
        finished = store.plan_keys(all_keys) | given_up
        rec.precompute_total, rec.precompute_done = len(keys), len(finished)
        store.apply(
            rec.id, {"precompute_total": rec.precompute_total, "precompute_done": rec.precompute_done}
        )
        return finished

    finished = progress()
    limit = service.settings.cap_time_limit(None, service.settings.precompute_time_limit_s).total_seconds()
    todo = [(k, sc) for k, sc in keys if k not in finished]
    # as many keys at once as the solver runs background solves (the Ray cluster's CPUs with Ray)
    slots = asyncio.Semaphore(getattr(service.solver, "background_slots", 1))

    async def plan_claimed(key: str, sc: FailureScenario) -> None:
        try:
            if coord.shared and store.plan_keys([key]):
                return  # another replica planned it meanwhile
            if not await _solve(service, rt, key, sc, limit):
                given_up.add(key)
                rt.precompute_failed = len(given_up)
        finally:
            coord.release_claim(key)
            slots.release()
        progress()

    while todo:
        claimed_elsewhere = []
        running: list[asyncio.Task[None]] = []
        try:
            for key, sc in todo:
                await slots.acquire()
                if rec.state == "finished":  # nobody will ask for another plan of this job
                    slots.release()
                    break
                if not coord.try_claim(key):
                    slots.release()
                    claimed_elsewhere.append((key, sc))
                    continue
                running.append(asyncio.create_task(plan_claimed(key, sc)))
            await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()
        if rec.state == "finished":
            return
        if claimed_elsewhere:
            await asyncio.sleep(RETRY_S)  # another replica is planning them: take over if it dies
            finished = progress()
        todo = [(k, sc) for k, sc in claimed_elsewhere if k not in finished]


async def _solve(service: JobService, rt: JobRuntime, key: str, sc: FailureScenario, limit: float) -> bool:
    """CP-SAT for one key in the background pool; the plan is stored. False when it failed."""
    rec = rt.record
    t0 = time.perf_counter()
    try:
        args = (rec.spec_json, sc.model_dump_json(), limit, True, *solve_mode(rec))
        out = await service.solver.submit_background(1, *args)
    except Exception:
        log.exception("job %s: precompute of %s failed", rec.id, key)
        return False
    service.metrics.solve_seconds.labels(purpose="precompute").observe(time.perf_counter() - t0)
    service.metrics.solves.labels(purpose="precompute", source=out.source or "error").inc()
    if out.error is not None:
        return False
    service.store.put_plan(PlanRecord(out.key, out.canonical_json, "refined", out.iteration_time_ms))
    return True


def _key(rt: JobRuntime, scenario: FailureScenario) -> str:
    from planner.normalize import normalize

    return plan_key(normalize(rt.job, scenario).key, rt.record.repartition)


MIN_CHECK_S = 0.01  # the heartbeat loop never wakes more often than this
STALL_S = 1.0  # the heartbeat loop's sleep overran one of its steps by more: the service stalled
STALL_STEP_S = 0.25  # the loop sleeps in steps this long to notice a stall in the middle of a sleep
STALL_RECHECK_S = 0.5  # after a check that judged nobody (a stall), the next one comes this soon
CHECK_SLACK_S = 0.005  # wake this long after a deadline, so that the silence is past the timeout


def scan_heartbeats(
    rt: JobRuntime, now: float, default_timeout_s: float
) -> tuple[list[tuple[int, int]], float | None]:
    """(silent workers, the earliest time another tracked worker's silence reaches the timeout).

    Liveness comes only from requests arriving: `last_seen` is the arrival of a worker's last
    heartbeat poll, and a poll still parked on an open socket does not count (a silently partitioned
    worker's socket stays open). Tracked: alive (not failed), not done workers that polled at least
    once, while the job runs with heartbeats on. After a restore every worker counts as seen at the
    end of the restore grace; while none of them has polled since, the job waits for its restart and
    none is tracked (a job whose workers are all gone is restored once, not again and again). Once one
    has polled, the others count as seen at that poll (or at the end of the grace, if later): a restart
    that comes back late is not failed worker by worker as its first poll arrives."""
    if not rt.record.heartbeat_enabled or rt.record.state != "running" or not rt.last_seen:
        return [], None
    timeout = rt.record.heartbeat_timeout_s or default_timeout_s
    failed = {(int(d), int(s)) for d, s in rt.scenario.failed}
    if rt.restore_until is not None:
        tracked = [seen for w, seen in rt.last_seen.items() if w not in failed and w not in rt.done]
        back = [seen for seen in tracked if seen != rt.restore_until]
        if not back:
            return [], None
        rt.restart_clocks(min(back))
    silent: list[tuple[int, int]] = []
    oldest: float | None = None
    for w, seen in rt.last_seen.items():
        if w in failed or w in rt.done:
            continue
        if now - seen > timeout:
            silent.append(w)
        elif oldest is None or seen < oldest:
            oldest = seen
    return sorted(silent), None if oldest is None else oldest + timeout


def silent_workers(rt: JobRuntime, now: float, default_timeout_s: float) -> list[tuple[int, int]]:
    """Alive, not done workers that polled at least once and sent no request for longer than the
    job's heartbeat timeout (a parked poll is no sign of life)."""
    return scan_heartbeats(rt, now, default_timeout_s)[0]


async def _sleep_watching(delay: float) -> float:
    """Sleep `delay` s in steps of STALL_STEP_S; the longest time a step overran (a stall)."""
    end, stalled = time.monotonic() + delay, 0.0
    while (left := end - time.monotonic()) > 0:
        step = min(STALL_STEP_S, left)
        start = time.monotonic()
        await asyncio.sleep(step)
        stalled = max(stalled, time.monotonic() - start - step)
    return stalled


async def heartbeat_loop(service: JobService) -> None:
    """Declare silent workers failed through the ordinary event path.

    Checks every heartbeat_check_s, and sooner when a tracked worker's silence reaches its job's
    timeout before then: a worker is declared failed right after `timeout` s without a request. On a
    store shared by replicas, poll arrivals are published to the store on every check and the other
    replicas' are adopted (every replica watches every worker, whichever replica it polls), and a
    worker another replica saw recently is not failed (api/job_sync.py's SharedHeartbeats). After the
    service itself did not run for over STALL_S (the process was stopped, the machine suspended or
    overloaded), a check judges nobody and publishes nothing: the polls that arrived meanwhile wait
    on sockets unread, and their workers would be failed for the service's own silence (here, or on
    another replica that takes the publication for "seen nothing up to now"); the next check
    follows shortly."""
    delay = service.settings.heartbeat_check_s
    shared = SharedHeartbeats(service) if service.coord.shared else None
    while True:
        stalled = await _sleep_watching(delay)
        if service.stopping:
            return
        now = time.monotonic()
        delay = service.settings.heartbeat_check_s
        if stalled > STALL_S:  # neither judged nor published: the polls that waited are read first
            log.warning("the service did not run for %.1f s: heartbeats not judged this time", stalled)
            delay = min(delay, STALL_RECHECK_S)
            continue
        if shared is not None:
            await shared.sync(now)
        for rt in list(service.jobs.values()):
            silent, deadline = scan_heartbeats(rt, now, service.settings.heartbeat_timeout_s)
            if deadline is not None:
                delay = min(delay, deadline - now + CHECK_SLACK_S)
            if silent and shared is not None:
                silent = shared.still_silent(rt, silent, now)
            if not silent:
                continue
            for w in silent:
                rt.last_seen.pop(w, None)
            event = EventIn(
                event_id=f"heartbeat-{uuid.uuid4().hex[:12]}",
                kind="fail",
                workers=silent,
                reason="heartbeat timeout",
            )
            service.metrics.heartbeat_failures.inc(len(silent))
            log.warning("job %s: workers %s silent, declaring them failed", rt.record.id, silent)
            try:
                await service.apply_event(rt.record.id, event, still_silent=True)
            except Exception:
                log.exception("job %s: heartbeat failure event failed", rt.record.id)
        delay = max(MIN_CHECK_S, delay - (time.monotonic() - now))
