"""Service settings, read from the environment with the prefix RECYCLE_ (e.g. RECYCLE_CONTROLLER_TOKEN).

get_settings() is the one provider; it is lru_cached, and create_app() or tests override it through
FastAPI's dependency_overrides. Every wait and solver limit here is capped so a request cannot ask
for more than the operator allowed.
"""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings

from planner.settings import SETTINGS_CONFIG


class Settings(BaseSettings):
    """Everything an operator can set; env var = RECYCLE_ + upper-case field name."""

    model_config = SETTINGS_CONFIG

    data_dir: Path = Field(default=Path("recycle-data"), description="Directory of the SQLite store.")
    database_url: SecretStr | None = Field(
        default=None,
        description="postgresql://user:password@host:port/db: store in PostgreSQL instead of SQLite (several "
        "replicas may share it); `--database` wins.",
    )
    database_pool_size: int = Field(
        default=16, ge=2, le=256, description="Most PostgreSQL connections of one service process."
    )
    database_timeout_s: float = Field(
        default=3.0,
        gt=0,
        le=60,
        description="Longest wait for a PostgreSQL connection (connect, or a free one in the pool) before a "
        "request is answered 503.",
    )
    test_kill_in_apply: str | None = Field(
        default=None,
        description="Test hook, never set in production: `before_commit:EVENT_ID` or `after_commit:EVENT_ID` "
        "makes the PostgreSQL store SIGKILL its own process while committing that event.",
    )
    controller_token: SecretStr | None = Field(
        default=None,
        description="The job controller's bearer token, for every /v1 endpoint (a job's workers may "
        "instead use the worker token its registration returned); required unless insecure_dev.",
    )
    insecure_dev: bool = Field(default=False, description="Run without any authentication (local dev only).")
    max_body_bytes: int = Field(default=1_000_000, ge=1024, description="Largest request body accepted.")
    max_workers_per_job: int = Field(default=4096, ge=1, description="Bound on D*P of a job spec.")
    max_ops_per_job: int = Field(
        default=300_000, ge=1, description="Bound on D*P*M (micro-batch slots) of a job spec."
    )
    max_time_limit_s: float = Field(default=30.0, gt=0, description="Cap on any solver time limit.")
    plan_time_limit_s: float = Field(default=5.0, gt=0, description="Default time limit of POST /v1/plan.")
    refine_time_limit_s: float = Field(default=10.0, gt=0, description="CP-SAT limit after a cache miss.")
    precompute_time_limit_s: float = Field(default=5.0, gt=0, description="CP-SAT limit per precomputed key.")
    max_failures_cap: int = Field(default=3, ge=0, le=4, description="Largest max_failures a job may ask.")
    max_wait_s: float = Field(default=60.0, gt=0, description="Cap on the long-poll `wait` parameter.")
    heartbeat_timeout_s: float = Field(
        default=30.0, ge=0.1, description="Silence after which a worker fails (at least 0.1 s)."
    )
    heartbeat_check_s: float = Field(default=1.0, gt=0, description="How often heartbeats are checked.")
    restore_grace_s: float = Field(
        default=60.0,
        ge=0,
        description="After a restore, extra time a worker has for its first poll (process start, torch "
        "import) before its heartbeat timeout counts.",
    )
    solver_processes: int = Field(default=1, ge=1, le=64, description="Processes for event-path solves.")
    background_processes: int = Field(default=1, ge=1, le=64, description="Processes for precompute/CP-SAT.")

    def cap_time_limit(self, seconds: float | None, default: float) -> timedelta:
        """`seconds` (or `default`) capped at max_time_limit_s."""
        value = default if seconds is None else seconds
        return timedelta(seconds=min(value, self.max_time_limit_s))

    def check_startable(self) -> None:
        """Refuse to run without a controller token unless insecure_dev was asked for."""
        if self.controller_token is None and not self.insecure_dev:
            raise RuntimeError(
                "no controller token: set RECYCLE_CONTROLLER_TOKEN (or pass --insecure-dev for local use)"
            )


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings (from the environment); tests override this dependency."""
    return Settings()
