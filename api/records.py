"""The store's records and the Store protocol the service depends on (api/store_sqlite.py and
api/store_pg.py implement it; api/store.py opens the one the settings name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class JobRecord:
    """One registered job and its current state."""

    id: str
    name: str
    spec_json: str
    worker_token_hash: str
    created_at: float
    state: str = "running"
    max_failures: int = 2
    heartbeat_enabled: bool = True
    heartbeat_timeout_s: float | None = None
    scenario_json: str = '{"failed": [], "slow": []}'
    version: int = 0
    unrecoverable_stages: list[int] = field(default_factory=list)
    precompute_total: int = 0
    precompute_done: int = 0
    done_workers: list[list[int]] = field(default_factory=list)  # alive workers that reported `done`
    restore_policy: str = "auto"  # auto: a lost stage is restored at once; manual: stays needs_restore
    restore: dict[str, Any] | None = None  # the latest restore {epoch, iteration}, carried by every version
    checkpoints: dict[str, list[int]] = field(default_factory=dict)  # stage -> newest reported iterations
    joined: dict[str, Any] = field(default_factory=dict)  # {"base": v, "since": {"d,s": v}}: api/restore.py
    repartition: bool = False  # plans choose the layer split too (issue 12; api/solve_partition.py)


@dataclass
class VersionRecord:
    """One schedule version of a job (versions start at 1 and grow by 1)."""

    job_id: str
    version: int
    scenario_json: str
    schedule_json: str
    source: str
    iteration_time_ms: float
    cause: str | None
    created_at: float


@dataclass
class EventRecord:
    """An applied event and the answer given, replayed verbatim for a repeated event_id."""

    job_id: str
    event_id: str
    seq: int
    body_json: str
    status_code: int
    result_json: str
    created_at: float


@dataclass
class PlanRecord:
    """The best known canonical schedule for a normalized scenario key."""

    key: str
    schedule_json: str
    source: str
    iteration_time_ms: float


@dataclass
class IdempotencyRecord:
    """A POST /v1/jobs that carried an Idempotency-Key: what a retry with the same key is answered.

    Only a hash of the key is kept; the worker token of the answer is kept encrypted with a key
    stream derived from the Idempotency-Key itself, so the store alone does not reveal it."""

    key_hash: str
    request_hash: str
    job_id: str
    status_code: int
    response_json: str  # the first answer, its worker_token blanked
    token_cipher: str  # hex
    created_at: float


class VersionConflictError(RuntimeError):
    """apply() was given a version that is not the job's current version + 1 (another replica
    committed first: the caller refreshes the job and the client retries)."""


class StoreUnavailableError(RuntimeError):
    """The database cannot be reached (PostgreSQL down or restarting): the request is answered 503
    and nothing was changed in memory; the store reconnects by itself."""


class SchemaTooNewError(RuntimeError):
    """The database was migrated by a newer version of recycle than this one."""


class Store(Protocol):
    """What the service needs from persistence. `shared` is true when several service processes
    (replicas) may use the same store at once (PostgreSQL): the service then coordinates through
    the database (api/store_coord.py) and refreshes its in-memory jobs from it."""

    @property
    def shared(self) -> bool: ...
    @property
    def path(self) -> object: ...  # where the data is, for logs (a file, or a URL without its password)

    def create_job(self, job: JobRecord, idempotency: IdempotencyRecord | None = None) -> None: ...
    def get_idempotency(self, key_hash: str) -> IdempotencyRecord | None: ...
    def get_job(self, job_id: str) -> JobRecord | None: ...
    def list_jobs(self) -> list[JobRecord]: ...
    def job_id_for_token_hash(self, token_hash: str) -> str | None: ...
    def apply(
        self,
        job_id: str,
        job_update: dict[str, Any],
        version: VersionRecord | None = None,
        event: EventRecord | None = None,
    ) -> None: ...
    def get_version(self, job_id: str, version: int) -> VersionRecord | None: ...
    def latest_version(self, job_id: str) -> VersionRecord | None: ...
    def list_versions(self, job_id: str) -> list[tuple[int, str, float, str | None, float]]: ...
    def get_event(self, job_id: str, event_id: str) -> EventRecord | None: ...
    def list_events(self, job_id: str, limit: int = 100) -> list[EventRecord]: ...
    def put_plan(self, plan: PlanRecord) -> bool: ...
    def get_plan(self, key: str) -> PlanRecord | None: ...
    def plan_keys(self, keys: list[str]) -> set[str]: ...
    def close(self) -> None: ...
