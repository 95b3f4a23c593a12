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
  every replica), and read back before a replica declares a worker failed: a worker that moved to
  another replica is not failed by the one it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg

from api.records import StoreUnavailableError
from api.store_coord import OnChange, OnResync, Worker, lock_key
from api.store_pg import _DOWN, CHANNEL, PostgresStore

log = logging.getLogger(__name__)

RECONNECT_S = 0.5
LOCK_WAIT_S = 60.0  # longest wait for another replica's job lock (a solve holds it for seconds at most)


class PgCoordinator:
    shared = True

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
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
        timeout = max(1, round(self.store.timeout))
        first = True
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.store.url, autocommit=True, connect_timeout=timeout) as conn:
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
                        conn.execute("SELECT 1")  # liveness probe: the server may be gone
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
        try:
            conn = await asyncio.to_thread(pool.getconn, store.timeout)
        except _DOWN as exc:
            raise StoreUnavailableError(f"database {store.path}: {exc}") from None
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            delay = 0.001
            try:
                while not conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]:  # type: ignore[index]
                    if time.monotonic() > deadline:
                        raise StoreUnavailableError(f"job {job_id}: another replica holds its lock")
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 0.02)
            except _DOWN as exc:
                raise StoreUnavailableError(f"database {store.path}: {exc}") from None
            try:
                yield
            finally:
                with contextlib.suppress(*_DOWN):
                    conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
        finally:
            pool.putconn(conn)

    def _claims_conn(self) -> psycopg.Connection[Any]:
        if self._claims is None or self._claims.closed or self._claims.broken:
            self._claims = psycopg.connect(
                self.store.url, autocommit=True, connect_timeout=max(1, round(self.store.timeout))
            )
        return self._claims

    def try_claim(self, key: str) -> bool:
        """Claim planning `key` (False: another replica is planning it now)."""
        if self.store.down:
            raise StoreUnavailableError(f"database {self.store.path} is unreachable (reconnecting)")
        try:
            row = self._claims_conn().execute("SELECT pg_try_advisory_lock(%s)", (lock_key("plan", key),))
            return bool(row.fetchone()[0])  # type: ignore[index]
        except _DOWN as exc:
            raise StoreUnavailableError(f"database {self.store.path}: {exc}") from None

    def release_claim(self, key: str) -> None:
        if self.store.down:
            return  # the session, and so the claim, is gone with the connection
        with contextlib.suppress(*_DOWN):
            self._claims_conn().execute("SELECT pg_advisory_unlock(%s)", (lock_key("plan", key),))

    def publish_seen(self, rows: list[tuple[str, int, int, float]]) -> None:
        """Record poll arrivals (job, d, s, wall-clock time); the latest per worker is kept."""
        if not rows:
            return
        with self.store.connection() as conn, conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO heartbeats (job_id, d, s, seen_at) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (job_id, d, s) DO UPDATE "
                "SET seen_at = greatest(heartbeats.seen_at, excluded.seen_at)",
                rows,
            )

    def seen_since(self, job_id: str, workers: list[Worker], since: float) -> dict[Worker, float]:
        """{worker: latest arrival} of `workers` that some replica saw poll after `since` (wall clock)."""
        with self.store.connection() as conn:
            rows = conn.execute(
                "SELECT d, s, seen_at FROM heartbeats WHERE job_id = %s AND seen_at > %s", (job_id, since)
            ).fetchall()
        wanted = set(workers)
        return {(int(d), int(s)): float(t) for d, s, t in rows if (int(d), int(s)) in wanted}
