"""Following the other replicas (a store shared by several service processes, PostgreSQL): the
listener of api/store_pg_coord.py calls on_change() on the event loop for every change another (or
this) replica committed to a job; the job is re-read from the store under its local lock and its
long-polls woken, so a poll parked on this replica answers an event that landed on another one.
Notifications for one job are coalesced: one refresh runs at a time and a later one follows if more
arrived meanwhile. After the listener reconnected (notifications may have been lost), on_resync()
re-reads every job and picks up the jobs registered meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time

from api.jobs import JobRuntime, JobService
from api.records import StoreUnavailableError

log = logging.getLogger(__name__)

RESYNC_TRIES, RESYNC_RETRY_S = 240, 0.5  # keep trying to re-read every job for two minutes
ADOPT_MARGIN_S = 5.0  # re-read rows this much older than the last read (another replica publishes late)


class ReplicaSync:
    """Refreshes `service`'s in-memory jobs from the store on notifications (see the module docstring)."""

    def __init__(self, service: JobService) -> None:
        self.service = service
        self._dirty: set[str] = set()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._resync: asyncio.Task[None] | None = None

    def on_change(self, job_id: str, version: int) -> None:
        """Re-read job `job_id` soon (its change at `version` committed; this replica's own commits
        too: their other fields are already in memory, the re-read is one cheap query)."""
        self._dirty.add(job_id)
        if job_id not in self._running:
            self._running[job_id] = asyncio.get_running_loop().create_task(self._refresh(job_id))

    def on_resync(self) -> None:
        """Re-read every job soon (the listener reconnected: notifications may have been lost)."""
        if self._resync is None or self._resync.done():
            self._resync = asyncio.get_running_loop().create_task(self._resync_all())

    async def _resync_all(self) -> None:
        for _ in range(RESYNC_TRIES):
            try:
                records = await asyncio.to_thread(self.service.store.list_jobs)
            except StoreUnavailableError as exc:
                log.warning("resync postponed: %s", exc)
                await asyncio.sleep(RESYNC_RETRY_S)
                continue
            for rec in records:
                self.on_change(rec.id, rec.version)
            return

    async def _refresh(self, job_id: str) -> None:
        service = self.service
        try:
            while job_id in self._dirty:
                self._dirty.discard(job_id)
                rt = service.jobs.get(job_id)
                if rt is None:
                    service.fetch(job_id)
                    continue
                async with rt.lock:
                    service.refresh(rt)
        except StoreUnavailableError as exc:
            log.warning("job %s: not refreshed: %s", job_id, exc)
        except Exception:
            log.exception("job %s: refresh failed", job_id)
        finally:
            self._running.pop(job_id, None)


class SharedHeartbeats:
    """Heartbeats over replicas: a worker's polls may reach any replica (a load balancer), so each
    replica publishes the arrivals it saw (wall-clock, to the store's `heartbeats` table) and adopts
    those the other replicas published: it watches every worker of every job that polled any replica,
    so a worker whose replica died is still failed when it goes silent. Before declaring a worker
    failed, it asks whether another replica saw it within the timeout, counted back from the earliest
    moment up to which every other live replica has published (and the job service asks once more
    under the job's lock: api/jobs.py)."""

    def __init__(self, service: JobService) -> None:
        self.service = service
        self._published: dict[tuple[str, tuple[int, int]], float] = {}
        self._read_until = 0.0  # wall clock of the last read of the table (0: read every row)

    async def sync(self, now: float) -> None:
        """Publish the arrivals since the last call and adopt the rows published since the last read
        (`now`: time.monotonic()). The database is used from a thread: the event loop never waits."""
        wall = time.time()
        fresh = {
            (job_id, w): seen
            for job_id, rt in list(self.service.jobs.items())
            for w, seen in list(rt.last_seen.items())
            if self._published.get((job_id, w)) != seen
        }
        rows = [(job_id, w[0], w[1], wall - (now - seen)) for (job_id, w), seen in fresh.items()]
        since = self._read_until - ADOPT_MARGIN_S
        try:
            seen_rows = await asyncio.to_thread(self._exchange, rows, wall, since)
        except StoreUnavailableError as exc:
            log.warning("heartbeats not shared: %s", exc)
            return
        self._published.update(fresh)
        self._prune()
        self._read_until = wall
        failed: dict[str, set[tuple[int, int]]] = {}
        for job_id, d, s, t in seen_rows:
            rt = self.service.jobs.get(job_id)
            if rt is None or not rt.record.heartbeat_enabled or rt.record.state != "running":
                continue
            if job_id not in failed:
                failed[job_id] = {(int(fd), int(fs)) for fd, fs in rt.scenario.failed}
            w = (d, s)
            if w in rt.done or w in failed[job_id]:
                continue
            arrival = now - (wall - t)
            if arrival > rt.last_seen.get(w, float("-inf")):
                rt.last_seen[w] = self._published[(job_id, w)] = arrival

    def _prune(self) -> None:
        """Forget what was published for workers no longer tracked (failed, done, or of a job gone),
        so the map stays as large as the heartbeats held in memory."""
        jobs = self.service.jobs
        stale = [k for k in self._published if k[0] not in jobs or k[1] not in jobs[k[0]].last_seen]
        for k in stale:
            del self._published[k]

    def _exchange(
        self, rows: list[tuple[str, int, int, float]], wall: float, since: float
    ) -> list[tuple[str, int, int, float]]:
        coord = self.service.coord
        coord.publish_seen(rows, wall, self.service.settings.heartbeat_check_s)
        return coord.seen_after(since)

    def still_silent(
        self, rt: JobRuntime, silent: list[tuple[int, int]], now: float
    ) -> list[tuple[int, int]]:
        """The workers of `silent` no replica saw within the job's timeout (counted back from the
        moment every other live replica has published up to: `seen_within`); the others count as
        seen at the arrival another replica published. Empty while the store is unreachable (no
        event could be committed anyway)."""
        timeout = self.service.heartbeat_timeout(rt)
        wall = time.time()
        try:
            seen = self.service.coord.seen_within(rt.record.id, silent, timeout)
        except StoreUnavailableError:
            return []
        # Seen: judged again when its silence reaches the timeout once more, but no sooner than the
        # next check (while a late replica holds the moment back, the arrival found may be that old).
        again = now - timeout + self.service.settings.heartbeat_check_s
        for w, t in seen.items():
            rt.last_seen[w] = max(now - (wall - t), again)
            self._published[(rt.record.id, w)] = rt.last_seen[w]
        return [w for w in silent if w not in seen]
