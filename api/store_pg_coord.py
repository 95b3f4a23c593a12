"""PgCoordinator: several replicas on one PostgreSQL (api/store_coord.py says what each part is for).

- **Job lock**: a session-level advisory lock `job:<id>` on a pooled connection held while one replica
  applies a change to the job (taken with pg_try_advisory_lock, retried without blocking the event
  loop). A replica that dies drops its session and so its locks; its open transaction rolls back.
- **Claims**: `plan:<key>` advisory locks on this replica's own claims connection, so a scenario is
  planned by one replica at a time and a dead replica's claims vanish with its session.
- **Wake-ups**: a listener thread LISTENs on api/store_pg.py's CHANNEL and hands every `<job>:<version>`
  to the event loop (the job is re-read and its long-polls woken). Its connection doubles as the
  liveness probe: while it is lost the store is marked down (requests answer 503 at once), and on
  reconnecting every job is re-read (notifications sent meanwhile were lost).
- **Heartbeats**: arrivals of worker polls are upserted into `heartbeats` (the latest per worker over
  every replica). Every replica reads back the rows of every job (`seen_after`) and watches those
  workers too, so a worker whose replica died is still failed when it goes silent; and each replica
  reads them again before declaring a worker failed (and once more under the job's lock, where the
  first replica's `fail` is seen by the others: one failure), so a worker that polls another replica
  is not failed. The store drops the rows of failed workers and finished jobs (api/store_pg.py).
  With its arrivals each replica writes when it wrote them (`replica_sync`); a worker counts as
  silent only as of the earliest such time of the other live replicas (that wrote within three of
  their checks), so a replica whose check runs late (a loaded machine) cannot get a worker that
  polls it failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from api.records import StoreUnavailableError
from api.store_coord import OnChange, OnResync, Seen, Worker, lock_key
from api.store_pg import _DOWN, CHANNEL, PostgresStore
from api.store_pg_watch import PROBE_STALL_S

log = logging.getLogger(__name__)

RECONNECT_S = 0.5
LIVE_CHECKS = 3  # a replica that wrote no arrivals for this many of its heartbeat checks is dead
SYNC_ROWS_KEPT_S = 3600.0  # a replica's replica_sync row outlives it this long (then deleted)
GETCONN_STEP_S = 0.25
LOCK_WAIT_S = 60.0  # longest wait for another replica's job lock (a solve holds it for seconds at most)


class PgCoordinator:
    shared = True

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.replica = uuid.uuid4().hex  # this process's row in replica_sync
        self._claims: psycopg.Connection[Any] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_change: OnChange, on_resync: OnResync) -> None:
        self._thread = threading.Thread(
            target=self._listen, args=(loop, on_change, on_resync), name="recycle-pg-listen", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._claims is not None:
            with contextlib.suppress(Exception):
                self._claims.close()

    def _listen(self, loop: asyncio.AbstractEventLoop, on_change: OnChange, on_resync: OnResync) -> None:
        first = True
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.store.url, autocommit=True, **self.store.connect_args()) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if self.store.down or not first:
                        log.warning("database %s reachable again", self.store.path)
                        self.store.reset_pool()
                        self.store.down = False
                        loop.call_soon_threadsafe(on_resync)
                    first = False
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=0.5):
                            job_id, _, version = note.payload.rpartition(":")
                            loop.call_soon_threadsafe(on_change, job_id, int(version))
                        with self.store.watchdog.watch(conn, PROBE_STALL_S, probe=True):
                            conn.execute("SELECT 1")  # liveness probe: the server may be gone or hang
            except (psycopg.Error, OSError) as exc:
                if not self.store.down:
                    log.warning(
                        "database %s unreachable: %s", self.store.path, str(exc).strip().splitlines()[:1]
                    )
                self.store.down = True
                first = False
                self._stopping.wait(RECONNECT_S)
            except RuntimeError:  # the event loop closed under us (shutdown)
                return

    @contextlib.asynccontextmanager
    async def job_lock(self, job_id: str) -> AsyncIterator[None]:
        """Hold job `job_id`'s advisory lock (see the module docstring)."""
        store = self.store
        if store.down:
            raise StoreUnavailableError(f"database {store.path} is unreachable (reconnecting)")
        key = lock_key("job", job_id)
        pool = store.pool  # the connection goes back to the pool it came from (reset_pool)
        conn = await _getconn(store, pool)
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            delay = 0.001
            watch = store.watchdog.watch
            try:
                while not _try_lock(conn, key, watch, store.timeout):
                    if time.monotonic() > deadline:
                        raise StoreUnavailableError(f"job {job_id}: another replica holds its lock")
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 0.02)
            except _DOWN as exc:
                raise StoreUnavailableError(f"database {store.path}: {exc}") from None
            try:
                yield
            finally:
                with contextlib.suppress(*_DOWN), watch(conn, store.timeout):
                    conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
        finally:
            pool.putconn(conn)

    def _claims_conn(self) -> psycopg.Connection[Any]:
        if self._claims is None or self._claims.closed or self._claims.broken:
            self._claims = psycopg.connect(self.store.url, autocommit=True, **self.store.connect_args())
        return self._claims

    def try_claim(self, key: str) -> bool:
        """Claim planning `key` (False: another replica is planning it now)."""
        if self.store.down:
            raise StoreUnavailableError(f"database {self.store.path} is unreachable (reconnecting)")
        try:
            return _try_lock(
                self._claims_conn(), lock_key("plan", key), self.store.watchdog.watch, self.store.timeout
            )
        except _DOWN as exc:
            raise StoreUnavailableError(f"database {self.store.path}: {exc}") from None

    def release_claim(self, key: str) -> None:
        if self.store.down:
            return  # the session, and so the claim, is gone with the connection
        with contextlib.suppress(*_DOWN):
            conn = self._claims_conn()
            with self.store.watchdog.watch(conn, self.store.timeout):
                conn.execute("SELECT pg_advisory_unlock(%s)", (lock_key("plan", key),))

    def publish_seen(self, rows: list[Seen], synced_at: float, check_s: float) -> None:
        """Record poll arrivals (job, d, s, wall-clock time; the latest per worker is kept) and that
        this replica has written every arrival it saw up to `synced_at` (wall clock) and writes
        again every `check_s`."""
        with self.store.connection() as conn, conn.cursor() as cur:
            if rows:
                cur.executemany(
                    "INSERT INTO heartbeats (job_id, d, s, seen_at) VALUES (%s, %s, %s, %s) "
                    "ON CONFLICT (job_id, d, s) DO UPDATE "
                    "SET seen_at = greatest(heartbeats.seen_at, excluded.seen_at)",
                    rows,
                )
            cur.execute(
                "INSERT INTO replica_sync (replica, synced_at, check_s) VALUES (%s, %s, %s) "
                "ON CONFLICT (replica) DO UPDATE "
                "SET synced_at = excluded.synced_at, check_s = excluded.check_s",
                (self.replica, synced_at, check_s),
            )
            cur.execute("DELETE FROM replica_sync WHERE synced_at < %s", (synced_at - SYNC_ROWS_KEPT_S,))

    def seen_after(self, since: float) -> list[tuple[str, int, int, float]]:
        """(job, d, s, latest arrival) of every worker some replica saw poll after `since` (wall clock)."""
        with self.store.connection() as conn:
            rows = conn.execute(
                "SELECT job_id, d, s, seen_at FROM heartbeats WHERE seen_at > %s", (since,)
            ).fetchall()
        return [(str(j), int(d), int(s), float(t)) for j, d, s, t in rows]

    def seen_within(self, job_id: str, workers: list[Worker], timeout_s: float) -> dict[Worker, float]:
        """{worker: latest arrival} of `workers` that some replica saw poll within `timeout_s` before
        the moment up to which every other live replica (one that wrote within LIVE_CHECKS of its
        checks) has written its arrivals: now, or the earliest such replica's last write."""
        wall = time.time()
        with self.store.connection() as conn:
            row = conn.execute(
                "SELECT min(synced_at) FROM replica_sync "
                "WHERE replica <> %s AND synced_at > %s - %s * check_s",
                (self.replica, wall, LIVE_CHECKS),
            ).fetchone()
            written = wall if row is None or row[0] is None else min(wall, float(row[0]))
            rows = conn.execute(
                "SELECT d, s, seen_at FROM heartbeats WHERE job_id = %s AND seen_at > %s",
                (job_id, written - timeout_s),
            ).fetchall()
        wanted = set(workers)
        return {(int(d), int(s)): float(t) for d, s, t in rows if (int(d), int(s)) in wanted}


def _try_lock(conn: psycopg.Connection[Any], key: int, watch: Any, limit_s: float) -> bool:
    """pg_try_advisory_lock(key) on `conn`, cut by the watchdog if the server hangs."""
    with watch(conn, limit_s):
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
    return bool(row is not None and row[0])


async def _getconn(store: PostgresStore, pool: Any) -> psycopg.Connection[Any]:
    """A connection of `pool` within the store's timeout, waited for in a thread in steps of
    GETCONN_STEP_S so that a store marked down meanwhile (the watchdog, the listener) is a 503 at once."""
    deadline = time.monotonic() + store.timeout
    while True:
        if store.down:
            raise StoreUnavailableError(f"database {store.path} is unreachable (reconnecting)")
        step = min(GETCONN_STEP_S, max(0.01, deadline - time.monotonic()))
        try:
            conn: psycopg.Connection[Any] = await asyncio.to_thread(pool.getconn, step)
            return conn
        except PoolTimeout as exc:
            if time.monotonic() >= deadline:
                raise StoreUnavailableError(f"database {store.path}: {exc}") from None
        except _DOWN as exc:
            raise StoreUnavailableError(f"database {store.path}: {exc}") from None
