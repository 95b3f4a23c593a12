"""The SQLite (WAL) store: the embedded default (`recycle serve --data-dir DIR`).

The store keeps jobs, their events (by event_id, for idempotent replay), every schedule version and
the precomputed plans (canonical schedules by normalized scenario key). All writes that belong to one
change go through apply() in one transaction, so a kill -9 leaves either all of it or none of it, and
a job's version only ever grows. One service process per file (api/store_pg.py serves several).
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from api.records import (
    EventRecord,
    IdempotencyRecord,
    JobRecord,
    PlanRecord,
    VersionConflictError,
    VersionRecord,
)
from api.store_rows import EVENT_UPSERT, StoreReads, job_values

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, spec_json TEXT NOT NULL, worker_token_hash TEXT NOT NULL,
    created_at REAL NOT NULL, state TEXT NOT NULL, max_failures INTEGER NOT NULL,
    heartbeat_enabled INTEGER NOT NULL, heartbeat_timeout_s REAL, scenario_json TEXT NOT NULL,
    version INTEGER NOT NULL, unrecoverable_stages TEXT NOT NULL,
    precompute_total INTEGER NOT NULL, precompute_done INTEGER NOT NULL,
    done_workers TEXT NOT NULL DEFAULT '[]', restore_policy TEXT NOT NULL DEFAULT 'manual',
    restore TEXT NOT NULL DEFAULT 'null', checkpoints TEXT NOT NULL DEFAULT '{}',
    joined TEXT NOT NULL DEFAULT '{}', repartition INTEGER NOT NULL DEFAULT 0);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_token ON jobs(worker_token_hash);
CREATE TABLE IF NOT EXISTS versions (
    job_id TEXT NOT NULL, version INTEGER NOT NULL, scenario_json TEXT NOT NULL, schedule_json TEXT NOT NULL,
    source TEXT NOT NULL, iteration_time_ms REAL NOT NULL, cause TEXT, created_at REAL NOT NULL,
    PRIMARY KEY (job_id, version));
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, event_id TEXT NOT NULL, seq INTEGER NOT NULL, body_json TEXT NOT NULL,
    status_code INTEGER NOT NULL, result_json TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (job_id, event_id));
CREATE TABLE IF NOT EXISTS plans (
    key TEXT PRIMARY KEY, schedule_json TEXT NOT NULL, source TEXT NOT NULL, iteration_time_ms REAL NOT NULL);
CREATE TABLE IF NOT EXISTS idempotency (
    key_hash TEXT PRIMARY KEY, request_hash TEXT NOT NULL, job_id TEXT NOT NULL, status_code INTEGER NOT NULL,
    response_json TEXT NOT NULL, token_cipher TEXT NOT NULL, created_at REAL NOT NULL);
"""


# Columns added after the first schema: (name, definition) for ALTER TABLE on an older store file. A job
# from before restores keeps the behaviour it was registered under: restore_policy 'manual'.
_ADDED_JOB_COLUMNS = (
    ("done_workers", "TEXT NOT NULL DEFAULT '[]'"),
    ("restore_policy", "TEXT NOT NULL DEFAULT 'manual'"),
    ("restore", "TEXT NOT NULL DEFAULT 'null'"),
    ("checkpoints", "TEXT NOT NULL DEFAULT '{}'"),
    ("joined", "TEXT NOT NULL DEFAULT '{}'"),
    ("repartition", "INTEGER NOT NULL DEFAULT 0"),
)


def _insert(db: sqlite3.Connection, table: str, vals: dict[str, Any]) -> None:
    marks = ", ".join("?" for _ in vals)
    db.execute(f"INSERT INTO {table} ({', '.join(vals)}) VALUES ({marks})", tuple(vals.values()))


DB_NAME = "recycle.sqlite3"


class SQLiteStore(StoreReads):
    """Store in `<data_dir>/recycle.sqlite3`, WAL mode, one connection guarded by a lock.

    synchronous=NORMAL in WAL mode: a committed transaction survives a crash of this process
    (kill -9); only an OS crash or power loss can drop the last transactions.
    """

    shared = False  # one service process per file

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / DB_NAME
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Add the job columns a store file written by an older version lacks."""
        have = {str(r[1]) for r in self._db.execute("PRAGMA table_info(jobs)").fetchall()}
        for name, definition in _ADDED_JOB_COLUMNS:
            if name not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {definition}")

    def _one(self, sql: str, args: tuple[Any, ...]) -> dict[str, Any] | None:
        with self._lock:
            row: sqlite3.Row | None = self._db.execute(sql, args).fetchone()
            return None if row is None else dict(row)

    def _all(self, sql: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._db.execute(sql, args).fetchall()]

    def create_job(self, job: JobRecord, idempotency: IdempotencyRecord | None = None) -> None:
        """Insert a new job (its id and token hash must be unused), and the Idempotency-Key record
        that names it, in one transaction: a retry after a lost answer finds both or neither."""
        values = job_values(asdict(job))
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(f"INSERT INTO jobs ({cols}) VALUES ({marks})", tuple(values.values()))
                if idempotency is not None:
                    _insert(db, "idempotency", asdict(idempotency))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def apply(
        self,
        job_id: str,
        job_update: dict[str, Any],
        version: VersionRecord | None = None,
        event: EventRecord | None = None,
    ) -> None:
        """Update the job, and add a version and/or an event, in one transaction.

        A version must be exactly the job's stored version + 1 (VersionConflictError otherwise);
        the job's `version` column is set from it.
        """
        update = job_values(job_update)
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                if version is not None:
                    row = db.execute("SELECT version FROM jobs WHERE id = ?", (job_id,)).fetchone()
                    if row is None or int(row[0]) + 1 != version.version:
                        raise VersionConflictError(
                            f"job {job_id}: version {version.version} does not follow "
                            f"{None if row is None else row[0]}"
                        )
                    vals = asdict(version)
                    db.execute(
                        f"INSERT INTO versions ({', '.join(vals)}) VALUES ({', '.join('?' for _ in vals)})",
                        tuple(vals.values()),
                    )
                    update["version"] = version.version
                if event is not None:  # written again with its final answer (an auto restore's 2nd version)
                    vals = asdict(event)
                    db.execute(
                        f"INSERT INTO events ({', '.join(vals)}) VALUES ({', '.join('?' for _ in vals)}) "
                        f"{EVENT_UPSERT}",
                        tuple(vals.values()),
                    )
                if update:
                    sets = ", ".join(f"{k} = ?" for k in update)
                    db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*update.values(), job_id))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def put_plan(self, plan: PlanRecord) -> bool:
        """Store `plan` unless a better one is stored for its key; True if stored.

        An equal plan replaces a stored one only to upgrade its source from "greedy" (not yet
        refined) to "refined" (CP-SAT has seen it), so a refined key is never refined again.
        """
        with self._lock:
            cur = self._db.execute(
                self.put_plan_sql(),
                (plan.key, plan.schedule_json, plan.source, plan.iteration_time_ms),
            )
            return cur.rowcount > 0

    def plan_keys(self, keys: list[str]) -> set[str]:
        """The subset of `keys` that have a stored plan."""
        found: set[str] = set()
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            marks = ", ".join("?" for _ in chunk)
            found |= {
                r["key"] for r in self._all(f"SELECT key FROM plans WHERE key IN ({marks})", tuple(chunk))
            }
        return found

    def close(self) -> None:
        with self._lock:
            self._db.close()
