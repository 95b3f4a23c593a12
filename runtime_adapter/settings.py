"""The runtime's environment settings: one place for every RECYCLE_* variable workers and launchers read.

Every wait is a timedelta with one variable to override it. Read when a worker or launcher starts (not
at import). `recycle --help` and docs/configuration.md list these fields; tests/test_settings.py checks
that they agree.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings

from planner.settings import SETTINGS_CONFIG, load_settings


class RuntimeSettings(BaseSettings):
    """Worker and launcher waits; env var = RECYCLE_ + upper-case field name."""

    model_config = SETTINGS_CONFIG

    version_wait_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a worker waits for a newer schedule version (and starts new rendezvous "
        "attempts for a member still starting), seconds.",
    )
    standby_wait_s: float = Field(
        default=600.0, gt=0, description="How long a warm standby waits to be called in, seconds."
    )
    group_timeout_s: float = Field(
        default=20.0, gt=0, description="Timeout of the store and of collectives of one version, seconds."
    )
    stall_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Longest a worker's compute op (F, B, W) may run before the worker ends itself as hung "
        "(exit 6), seconds; default: the group timeout.",
    )
    poll_wait_s: float = Field(
        default=30.0, gt=0, description="Long-poll wait a worker asks the planner service for, seconds."
    )
    max_backoff_s: float = Field(
        default=2.0, gt=0, description="Largest backoff between a worker's reconnect attempts, seconds."
    )
    checkpoint_every: int = Field(
        default=0, ge=0, description="Default of --checkpoint-every: stepped iterations between checkpoints."
    )
    fork_workers: bool = Field(
        default=True,
        description="Start the workers of a --device cpu launch or agent by forking a process that has "
        "imported torch once (runtime_adapter/forkserver.py); 0: a plain process each.",
    )
    controller_token: SecretStr | None = Field(
        default=None, description="Default of `recycle launch --controller-token` (the service's token)."
    )

    @property
    def version_wait(self) -> timedelta:
        """`version_wait_s` as a timedelta."""
        return timedelta(seconds=self.version_wait_s)

    @property
    def standby_wait(self) -> timedelta:
        """`standby_wait_s` as a timedelta."""
        return timedelta(seconds=self.standby_wait_s)

    @property
    def group_timeout(self) -> timedelta:
        """`group_timeout_s` as a timedelta."""
        return timedelta(seconds=self.group_timeout_s)

    @property
    def stall_timeout(self) -> float:
        """`stall_timeout_s`, or the group timeout when unset (runtime_adapter/stall.py), seconds."""
        return self.group_timeout_s if self.stall_timeout_s is None else self.stall_timeout_s

    @property
    def poll_wait(self) -> timedelta:
        """`poll_wait_s` as a timedelta."""
        return timedelta(seconds=self.poll_wait_s)

    @property
    def max_backoff(self) -> timedelta:
        """`max_backoff_s` as a timedelta."""
        return timedelta(seconds=self.max_backoff_s)


def runtime_settings() -> RuntimeSettings:
    """The runtime settings from the environment now (cheap; not cached, so tests can set variables)."""
    return load_settings(RuntimeSettings)
