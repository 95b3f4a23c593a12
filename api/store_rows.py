"""What the SQLite and PostgreSQL stores share: row <-> record conversion (the job's list/dict fields
are kept as JSON text in both: one table layout) and the read queries (StoreReads), written with `?`
placeholders; a store gives its own _one/_all and placeholder."""

from __future__ import annotations

import json
from typing import Any

from api.records import EventRecord, IdempotencyRecord, JobRecord, PlanRecord, VersionRecord

JOB_COLS = list(JobRecord.__dataclass_fields__)
# An event written again keeps its first row and takes the final answer (SQLite and PostgreSQL syntax).
EVENT_UPSERT = (
    "ON CONFLICT (job_id, event_id) DO UPDATE SET status_code = excluded.status_code, "
    "result_json = excluded.result_json"
)
JSON_COLS = ("unrecoverable_stages", "done_workers", "restore", "checkpoints", "joined")
BOOL_COLS = ("heartbeat_enabled", "repartition")  # INTEGER 0/1 in SQLite, BOOLEAN in PostgreSQL


def job_from_dict(d: dict[str, Any]) -> JobRecord:
    """A JobRecord from a row of the jobs table (as a dict)."""
    d = dict(d)
    for col in BOOL_COLS:
        d[col] = bool(d[col])
    for col in JSON_COLS:
        d[col] = json.loads(d[col])
    return JobRecord(**d)


def job_values(update: dict[str, Any], bool_as_int: bool = True) -> dict[str, Any]:
    """Column values for `update` (JSON fields serialized); KeyError for an unknown field."""
    out = dict(update)
    for col in JSON_COLS:
        if col in out:
            out[col] = json.dumps(out[col])
    for col in BOOL_COLS:
        if col in out:
            out[col] = int(out[col]) if bool_as_int else bool(out[col])
    unknown = set(out) - set(JOB_COLS)
    if unknown:
        raise KeyError(f"unknown job fields: {sorted(unknown)}")
    return out


class StoreReads:
    """The read methods of the Store protocol over a store's `_one` / `_all` (rows as dicts)."""

    PLACEHOLDER = "?"

    def _one(self, sql: str, args: tuple[Any, ...]) -> dict[str, Any] | None:
        raise NotImplementedError

    def _all(self, sql: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _q(self, sql: str) -> str:
        return sql if self.PLACEHOLDER == "?" else sql.replace("?", self.PLACEHOLDER)

    def get_idempotency(self, key_hash: str) -> IdempotencyRecord | None:
        row = self._one(self._q("SELECT * FROM idempotency WHERE key_hash = ?"), (key_hash,))
        return None if row is None else IdempotencyRecord(**row)

    def get_job(self, job_id: str) -> JobRecord | None:
        row = self._one(self._q("SELECT * FROM jobs WHERE id = ?"), (job_id,))
        return None if row is None else job_from_dict(row)

    def list_jobs(self) -> list[JobRecord]:
        return [job_from_dict(r) for r in self._all("SELECT * FROM jobs ORDER BY created_at", ())]

    def job_id_for_token_hash(self, token_hash: str) -> str | None:
        row = self._one(self._q("SELECT id FROM jobs WHERE worker_token_hash = ?"), (token_hash,))
        return None if row is None else str(row["id"])

    def get_version(self, job_id: str, version: int) -> VersionRecord | None:
        row = self._one(self._q("SELECT * FROM versions WHERE job_id = ? AND version = ?"), (job_id, version))
        return None if row is None else VersionRecord(**row)

    def latest_version(self, job_id: str) -> VersionRecord | None:
        sql = "SELECT * FROM versions WHERE job_id = ? ORDER BY version DESC LIMIT 1"
        row = self._one(self._q(sql), (job_id,))
        return None if row is None else VersionRecord(**row)

    def list_versions(self, job_id: str) -> list[tuple[int, str, float, str | None, float]]:
        """(version, source, iteration_time_ms, cause, created_at) of every version, oldest first."""
        rows = self._all(
            self._q(
                "SELECT version, source, iteration_time_ms, cause, created_at FROM versions "
                "WHERE job_id = ? ORDER BY version"
            ),
            (job_id,),
        )
        return [
            (
                int(r["version"]),
                str(r["source"]),
                float(r["iteration_time_ms"]),
                r["cause"],
                float(r["created_at"]),
            )
            for r in rows
        ]

    def get_event(self, job_id: str, event_id: str) -> EventRecord | None:
        row = self._one(self._q("SELECT * FROM events WHERE job_id = ? AND event_id = ?"), (job_id, event_id))
        return None if row is None else EventRecord(**row)

    def list_events(self, job_id: str, limit: int = 100) -> list[EventRecord]:
        sql = "SELECT * FROM events WHERE job_id = ? ORDER BY seq DESC LIMIT ?"
        rows = self._all(self._q(sql), (job_id, limit))
        return [EventRecord(**r) for r in reversed(rows)]

    def get_plan(self, key: str) -> PlanRecord | None:
        row = self._one(self._q("SELECT * FROM plans WHERE key = ?"), (key,))
        return None if row is None else PlanRecord(**row)

    def put_plan_sql(self) -> str:
        """The upsert that keeps the best plan per key (an equal one replaces a stored one only to
        upgrade its source from "greedy" to a refined one)."""
        return self._q(
            "INSERT INTO plans (key, schedule_json, source, iteration_time_ms) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET schedule_json = excluded.schedule_json, "
            "source = excluded.source, iteration_time_ms = excluded.iteration_time_ms "
            "WHERE excluded.iteration_time_ms < plans.iteration_time_ms - 1e-9 "
            "OR (excluded.iteration_time_ms <= plans.iteration_time_ms + 1e-9 "
            "AND plans.source = 'greedy' AND excluded.source != 'greedy')"
        )
