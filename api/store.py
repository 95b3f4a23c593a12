"""Persistence: one small Store interface and its SQLite (WAL) implementation.

The store keeps jobs, their events (by event_id, for idempotent replay), every schedule version and
the precomputed plans (canonical schedules by normalized scenario key). All writes that belong to one
change go through apply() in one transaction, so a kill -9 leaves either all of it or none of it, and
a job's version only ever grows. Another backend (PostgreSQL) implements the same Protocol.
"""

from __future__ import annotations

import json
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
    Store,
    VersionConflictError,
    VersionRecord,
)

__all__ = [
    "EventRecord",
    "IdempotencyRecord",
    "JobRecord",
    "PlanRecord",
    "SQLiteStore",
    "Store",
    "VersionConflictError",
    "VersionRecord",
]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, spec_json TEXT NOT NULL, worker_token_hash TEXT NOT NULL,
    created_at REAL NOT NULL, state TEXT NOT NULL, max_failures INTEGER NOT NULL,
    heartbeat_enabled INTEGER NOT NULL, heartbeat_timeout_s REAL, scenario_json TEXT NOT NULL,
    version INTEGER NOT NULL, unrecoverable_stages TEXT NOT NULL,
    precompute_total INTEGER NOT NULL, precompute_done INTEGER NOT NULL,
    done_workers TEXT NOT NULL DEFAULT '[]', restore_policy TEXT NOT NULL DEFAULT 'manual',
    restore TEXT NOT NULL DEFAULT 'null', checkpoints TEXT NOT NULL DEFAULT '{}',
    joined TEXT NOT NULL DEFAULT '{}');
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


_JOB_COLS = [f for f in JobRecord.__dataclass_fields__]
_JSON_COLS = ("unrecoverable_stages", "done_workers", "restore", "checkpoints", "joined")

# Columns added after the first schema: (name, definition) for ALTER TABLE on an older store file. A job
# from before restores keeps the behaviour it was registered under: restore_policy 'manual'.
_ADDED_JOB_COLUMNS = (
    ("done_workers", "TEXT NOT NULL DEFAULT '[]'"),
    ("restore_policy", "TEXT NOT NULL DEFAULT 'manual'"),
    ("restore", "TEXT NOT NULL DEFAULT 'null'"),
    ("checkpoints", "TEXT NOT NULL DEFAULT '{}'"),
    ("joined", "TEXT NOT NULL DEFAULT '{}'"),
)


def _job_from_row(row: sqlite3.Row) -> JobRecord:
    d = dict(row)
    d["heartbeat_enabled"] = bool(d["heartbeat_enabled"])
    for col in _JSON_COLS:
        d[col] = json.loads(d[col])
    return JobRecord(**d)


def _job_values(update: dict[str, Any]) -> dict[str, Any]:
    out = dict(update)
    for col in _JSON_COLS:
        if col in out:
            out[col] = json.dumps(out[col])
    if "heartbeat_enabled" in out:
        out["heartbeat_enabled"] = int(out["heartbeat_enabled"])
    unknown = set(out) - set(_JOB_COLS)
    if unknown:
        raise KeyError(f"unknown job fields: {sorted(unknown)}")
    return out


def _insert(db: sqlite3.Connection, table: str, vals: dict[str, Any]) -> None:
    marks = ", ".join("?" for _ in vals)
    db.execute(f"INSERT INTO {table} ({', '.join(vals)}) VALUES ({marks})", tuple(vals.values()))


class SQLiteStore:
    """Store in `<data_dir>/recycle.sqlite3`, WAL mode, one connection guarded by a lock.

    synchronous=NORMAL in WAL mode: a committed transaction survives a crash of this process
    (kill -9); only an OS crash or power loss can drop the last transactions.
    """

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / "recycle.sqlite3"
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

    def _one(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Row | None:
        with self._lock:
            row: sqlite3.Row | None = self._db.execute(sql, args).fetchone()
            return row

    def _all(self, sql: str, args: tuple[Any, ...]) -> list[sqlite3.Row]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    def create_job(self, job: JobRecord, idempotency: IdempotencyRecord | None = None) -> None:
        """Insert a new job (its id and token hash must be unused), and the Idempotency-Key record
        that names it, in one transaction: a retry after a lost answer finds both or neither."""
        values = _job_values(asdict(job))
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

    def get_idempotency(self, key_hash: str) -> IdempotencyRecord | None:
        row = self._one("SELECT * FROM idempotency WHERE key_hash = ?", (key_hash,))
        return None if row is None else IdempotencyRecord(**dict(row))

    def get_job(self, job_id: str) -> JobRecord | None:
        row = self._one("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return None if row is None else _job_from_row(row)

    def list_jobs(self) -> list[JobRecord]:
        return [_job_from_row(r) for r in self._all("SELECT * FROM jobs ORDER BY created_at", ())]

    def job_id_for_token_hash(self, token_hash: str) -> str | None:
        row = self._one("SELECT id FROM jobs WHERE worker_token_hash = ?", (token_hash,))
        return None if row is None else str(row["id"])

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
        update = _job_values(job_update)
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
                if event is not None:
                    vals = asdict(event)
                    db.execute(
                        f"INSERT INTO events ({', '.join(vals)}) VALUES ({', '.join('?' for _ in vals)})",
                        tuple(vals.values()),
                    )
                if update:
                    sets = ", ".join(f"{k} = ?" for k in update)
                    db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*update.values(), job_id))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def get_version(self, job_id: str, version: int) -> VersionRecord | None:
        row = self._one("SELECT * FROM versions WHERE job_id = ? AND version = ?", (job_id, version))
        return None if row is None else VersionRecord(**dict(row))

    def latest_version(self, job_id: str) -> VersionRecord | None:
        row = self._one("SELECT * FROM versions WHERE job_id = ? ORDER BY version DESC LIMIT 1", (job_id,))
        return None if row is None else VersionRecord(**dict(row))

    def list_versions(self, job_id: str) -> list[tuple[int, str, float, str | None, float]]:
        """(version, source, iteration_time_ms, cause, created_at) of every version, oldest first."""
        rows = self._all(
            "SELECT version, source, iteration_time_ms, cause, created_at FROM versions "
            "WHERE job_id = ? ORDER BY version",
            (job_id,),
        )
        return [(int(r[0]), str(r[1]), float(r[2]), r[3], float(r[4])) for r in rows]

    def get_event(self, job_id: str, event_id: str) -> EventRecord | None:
        row = self._one("SELECT * FROM events WHERE job_id = ? AND event_id = ?", (job_id, event_id))
        return None if row is None else EventRecord(**dict(row))

    def list_events(self, job_id: str, limit: int = 100) -> list[EventRecord]:
        rows = self._all("SELECT * FROM events WHERE job_id = ? ORDER BY seq DESC LIMIT ?", (job_id, limit))
        return [EventRecord(**dict(r)) for r in reversed(rows)]

    def put_plan(self, plan: PlanRecord) -> bool:
        """Store `plan` unless a better one is stored for its key; True if stored.

        An equal plan replaces a stored one only to upgrade its source from "greedy" (not yet
        refined) to "refined" (CP-SAT has seen it), so a refined key is never refined again.
        """
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO plans (key, schedule_json, source, iteration_time_ms) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET schedule_json = excluded.schedule_json, "
                "source = excluded.source, iteration_time_ms = excluded.iteration_time_ms "
                "WHERE excluded.iteration_time_ms < plans.iteration_time_ms - 1e-9 "
                "OR (excluded.iteration_time_ms <= plans.iteration_time_ms + 1e-9 "
                "AND plans.source = 'greedy' AND excluded.source != 'greedy')",
                (plan.key, plan.schedule_json, plan.source, plan.iteration_time_ms),
            )
            return cur.rowcount > 0

    def get_plan(self, key: str) -> PlanRecord | None:
        row = self._one("SELECT * FROM plans WHERE key = ?", (key,))
        return None if row is None else PlanRecord(**dict(row))

    def plan_keys(self, keys: list[str]) -> set[str]:
        """The subset of `keys` that have a stored plan."""
        found: set[str] = set()
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            marks = ", ".join("?" for _ in chunk)
            found |= {r[0] for r in self._all(f"SELECT key FROM plans WHERE key IN ({marks})", tuple(chunk))}
        return found

    def close(self) -> None:
        with self._lock:
            self._db.close()
