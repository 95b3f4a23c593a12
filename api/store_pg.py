"""The PostgreSQL store (psycopg 3 and a psycopg_pool connection pool): the Store protocol of
api/records.py for several service replicas on one database.

Every write that belongs to one change is one transaction, as in SQLite; apply() takes the job's row
lock (SELECT ... FOR UPDATE) and checks that a version is the stored one plus one, so replicas racing
on one job never write a version twice or go back. Every committed change to a job sends a NOTIFY on
CHANNEL (`<job id>:<version>`, delivered at commit) that the other replicas' listeners turn into
in-memory refreshes and long-poll wake-ups (api/store_coord.py). A lost connection, a server that is
down or restarting, or a pool with no free connection within RECYCLE_DATABASE_TIMEOUT_S is
StoreUnavailableError (503); the pool checks connections before handing them out and reconnects. A
call to a server that hangs is cut after RECYCLE_DATABASE_TIMEOUT_S, or about a second once the
listener's probe hangs (api/store_pg_watch.py), so the event loop is never blocked for longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from api.records import (
    EventRecord,
    IdempotencyRecord,
    JobRecord,
    PlanRecord,
    StoreUnavailableError,
    VersionConflictError,
    VersionRecord,
)
from api.settings import Settings
from api.store_migrate import migrate
from api.store_pg_watch import Watchdog
from api.store_rows import EVENT_UPSERT, StoreReads, job_values
from planner.errors import InvalidInputError

log = logging.getLogger(__name__)

CHANNEL = "recycle_jobs"
LOOP_POOL_WAIT_S = 0.25  # on the event loop: longest wait for a connection of a full pool,
LOOP_GROW_WAIT_S = 1.0  # and for one the pool is opening
# unreachable, restarting, hanging or overloaded (OperationalError covers serialization failures and
# deadlocks too), or a read-only standby after a failover: a 503, retry
_DOWN = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout, psycopg.errors.ReadOnlySqlTransaction)
_FIELDS = {  # columns as the request fields they come from
    ("jobs", "name"): "job.name",
    ("events", "event_id"): "event_id",
    ("versions", "cause"): "event_id",
}


def check_url(url: str) -> dict[str, Any]:
    """The URL's connection parameters; ValueError (one line) when it is not a postgresql:// URL."""
    if not url.startswith(("postgresql://", "postgres://")):
        raise ValueError(f"database URL {redact(url)!r}: must start with postgresql://")
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"database URL {redact(url)!r} does not parse: {str(exc).strip()}") from None
    for port in str(params.get("port", "5432")).split(","):
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"database URL {redact(url)!r} does not parse: port {port!r} is not 1..65535")
    return params


def redact(url: str) -> str:
    """`url` without its password (for logs and error messages)."""
    head, sep, tail = url.partition("://")
    if "@" not in tail:
        return url
    cred, _, host = tail.rpartition("@")
    user = cred.split(":", 1)[0]
    return f"{head}{sep}{user}{':***' if ':' in cred else ''}@{host}"


class PostgresStore(StoreReads):
    """Store in PostgreSQL (see the module docstring)."""

    shared = True  # several replicas on one database
    PLACEHOLDER = "%s"

    def __init__(self, url: str, settings: Settings) -> None:
        check_url(url)
        self.url, self.path = url, redact(url)
        self.timeout = settings.database_timeout_s
        self.down = False  # set by the listener while the server is unreachable: fail fast, 503
        self._kill = _kill_hook(settings.test_kill_in_apply)
        try:
            with psycopg.connect(url, connect_timeout=max(1, round(self.timeout))) as conn:
                before, after = migrate(conn)
        except _DOWN as exc:
            raise StoreUnavailableError(f"cannot connect to {self.path}: {_first_line(exc)}") from None
        if before != after:
            log.info("database %s: schema migrated from version %d to %d", self.path, before, after)
        self._pool_size = settings.database_pool_size
        self.watchdog = Watchdog(self._server_hung)
        self.pool = self._new_pool()

    def _server_hung(self) -> None:
        self.down = True  # until the listener reconnects (api/store_pg_coord.py)

    def _check(self, conn: psycopg.Connection[Any]) -> None:
        """The pool's check of a connection before handing it out, cut when the server hangs."""
        with self.watchdog.watch(conn, self.timeout):
            ConnectionPool.check_connection(conn)

    def _new_pool(self) -> ConnectionPool[Any]:
        return ConnectionPool(
            self.url,
            min_size=1,
            max_size=self._pool_size,
            timeout=self.timeout,
            kwargs={"autocommit": True, **self.connect_args()},
            check=self._check,
            open=True,
            name="recycle",
        )

    def _pool_wait(self) -> float:
        """How long to wait for a pooled connection: the timeout in a thread; on the event loop (where
        waiting stalls every request of the process) LOOP_POOL_WAIT_S once the pool is at its size
        limit (every connection busy: better a 503 at once), LOOP_GROW_WAIT_S while it opens one."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self.timeout
        full = self.pool.get_stats().get("pool_size", 0) >= self._pool_size
        return min(self.timeout, LOOP_POOL_WAIT_S if full else LOOP_GROW_WAIT_S)

    def connect_args(self) -> dict[str, Any]:
        """psycopg.connect() arguments of every connection: the connect timeout, and an application
        name that tells the replicas apart in pg_stat_activity (`recycle-<pid>`)."""
        return {"connect_timeout": max(1, round(self.timeout)), "application_name": f"recycle-{os.getpid()}"}

    def reset_pool(self) -> None:
        """A fresh pool (the server is back after an outage): the old one may still be backing off
        its reconnection attempts. Connections in use go back to the old pool, which closes them."""
        old, self.pool = self.pool, self._new_pool()
        threading.Thread(
            target=old.close, kwargs={"timeout": 5}, name="recycle-pg-pool-close", daemon=True
        ).start()

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection (autocommit); StoreUnavailableError when the database is unreachable."""
        if self.down:
            raise StoreUnavailableError(f"database {self.path} is unreachable (reconnecting)")
        try:
            with (
                self.pool.connection(timeout=self._pool_wait()) as conn,
                self.watchdog.watch(conn, self.timeout),
            ):
                yield conn
        except _DOWN as exc:
            raise StoreUnavailableError(f"database {self.path}: {_first_line(exc)}") from None

    def _one(self, sql: str, args: tuple[Any, ...]) -> dict[str, Any] | None:
        if _has_nul(args):
            return None  # PostgreSQL text never holds a NUL: no row has this key (a 404, not a 500)
        with self.connection() as conn:
            row: dict[str, Any] | None = conn.cursor(row_factory=dict_row).execute(sql, args).fetchone()
            return row

    def _all(self, sql: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        if _has_nul(args):
            return []
        with self.connection() as conn:
            return conn.cursor(row_factory=dict_row).execute(sql, args).fetchall()

    def create_job(self, job: JobRecord, idempotency: IdempotencyRecord | None = None) -> None:
        """Insert a new job and its Idempotency-Key record in one transaction (and tell the replicas)."""
        with self.connection() as conn, _raced(), conn.transaction():
            _insert(conn, "jobs", job_values(asdict(job), bool_as_int=False))
            if idempotency is not None:
                _insert(conn, "idempotency", asdict(idempotency))
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{job.id}:{job.version}"))

    def apply(
        self,
        job_id: str,
        job_update: dict[str, Any],
        version: VersionRecord | None = None,
        event: EventRecord | None = None,
    ) -> None:
        """Update the job, and add a version and/or an event, in one transaction under the job's row
        lock; a version must be the stored one + 1 (VersionConflictError otherwise)."""
        update = job_values(job_update, bool_as_int=False)
        with self.connection() as conn, _raced():
            with conn.transaction():
                row = conn.execute("SELECT version FROM jobs WHERE id = %s FOR UPDATE", (job_id,)).fetchone()
                if row is None:
                    raise VersionConflictError(f"job {job_id}: not in the database")
                stored = int(row[0])
                if version is not None:
                    if stored + 1 != version.version:
                        raise VersionConflictError(
                            f"job {job_id}: version {version.version} does not follow {stored}"
                        )
                    _insert(conn, "versions", asdict(version))
                    update["version"] = stored = version.version
                if event is not None:  # written again with its final answer (an auto restore's 2nd version)
                    _insert(conn, "events", asdict(event), EVENT_UPSERT)
                if update:
                    sets = ", ".join(f"{k} = %s" for k in update)
                    conn.execute(f"UPDATE jobs SET {sets} WHERE id = %s", (*update.values(), job_id))
                _sync_heartbeats(conn, job_id, update)
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{job_id}:{stored}"))
                self._maybe_kill("before_commit", event)
            self._maybe_kill("after_commit", event)

    def _maybe_kill(self, point: str, event: EventRecord | None) -> None:
        if self._kill is not None and event is not None and self._kill == (point, event.event_id):
            os.kill(os.getpid(), signal.SIGKILL)  # RECYCLE_TEST_KILL_IN_APPLY: a crash at this point

    def put_plan(self, plan: PlanRecord) -> bool:
        """Store `plan` unless a better one is stored for its key (put_plan_sql); True if stored."""
        with self.connection() as conn:
            cur = conn.execute(
                self.put_plan_sql(),
                (plan.key, plan.schedule_json, plan.source, plan.iteration_time_ms),
            )
            return cur.rowcount > 0

    def plan_keys(self, keys: list[str]) -> set[str]:
        """The subset of `keys` that have a stored plan."""
        rows = self._all("SELECT key FROM plans WHERE key = ANY(%s)", (keys,))
        return {str(r["key"]) for r in rows}

    def close(self) -> None:
        self.watchdog.close()
        self.pool.close()


@contextlib.contextmanager
def _raced() -> Iterator[None]:
    """A unique key another replica wrote first (the same Idempotency-Key registered on two replicas
    at once, or an event_id while a job lock was lost with its connection): VersionConflictError,
    answered 503 so that the client retries and gets the replay."""
    try:
        yield
    except psycopg.errors.UniqueViolation as exc:
        raise VersionConflictError(f"another replica wrote this first, retry: {_first_line(exc)}") from None


def _insert(conn: psycopg.Connection[Any], table: str, vals: dict[str, Any], tail: str = "") -> None:
    for col, val in vals.items():
        if isinstance(val, str) and "\x00" in val:  # SQLite takes it; PostgreSQL text cannot hold it
            raise InvalidInputError(f"{_FIELDS.get((table, col), col)}: contains a NUL character (\\u0000)")
    marks = ", ".join("%s" for _ in vals)
    conn.execute(f"INSERT INTO {table} ({', '.join(vals)}) VALUES ({marks}) {tail}", tuple(vals.values()))


def _has_nul(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, str) and "\x00" in a for a in args)


def _sync_heartbeats(conn: psycopg.Connection[Any], job_id: str, update: dict[str, Any]) -> None:
    """Keep the job's `heartbeats` rows in step with the change (same transaction): a finished job's
    rows go, a failed worker's row goes (a re-joiner is tracked again from its next poll), and new
    heartbeat switches count every worker as seen now (as api/jobs.py's set_switches does in memory),
    so that no replica fails a worker on an arrival older than the switch."""
    if update.get("state") == "finished":
        conn.execute("DELETE FROM heartbeats WHERE job_id = %s", (job_id,))
    elif "scenario_json" in update:
        failed = json.loads(update["scenario_json"]).get("failed") or []
        if failed:
            conn.execute(
                "DELETE FROM heartbeats WHERE job_id = %s AND (d, s) IN "
                "(SELECT * FROM unnest(%s::int[], %s::int[]))",
                (job_id, [int(w[0]) for w in failed], [int(w[1]) for w in failed]),
            )
    if "heartbeat_enabled" in update or "heartbeat_timeout_s" in update:
        conn.execute(
            "UPDATE heartbeats SET seen_at = greatest(seen_at, %s) WHERE job_id = %s", (time.time(), job_id)
        )


def _kill_hook(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    point, _, event_id = text.partition(":")
    if point not in ("before_commit", "after_commit") or not event_id:
        raise ValueError(f"RECYCLE_TEST_KILL_IN_APPLY: {text!r} is not before_commit:ID or after_commit:ID")
    return point, event_id


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
