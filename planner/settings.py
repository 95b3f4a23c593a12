"""The planner's environment settings: one place for every RECYCLE_* variable the planner reads.

Read when a plan starts (not at import), so a variable set after import still counts. `recycle --help`
and docs/configuration.md list these fields; tests/test_settings.py checks that they agree.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from planner.errors import InvalidInputError

S = TypeVar("S", bound=BaseSettings)


# Every settings class reads RECYCLE_* and refuses NaN and Infinity (a timeout of "inf" would
# silently switch a check off).
SETTINGS_CONFIG = SettingsConfigDict(env_prefix="RECYCLE_", extra="ignore", allow_inf_nan=False)


class PlannerSettings(BaseSettings):
    """Planner limits; env var = RECYCLE_ + upper-case field name."""

    model_config = SETTINGS_CONFIG

    solver_time_limit_s: float = Field(
        default=10.0, gt=0, description="Default CP-SAT time limit of library calls to plan(), seconds."
    )
    greedy_budget_s: float = Field(
        default=10.0,
        ge=0,
        description="How long the greedy portfolio may try further policies, seconds (never longer than "
        "the plan's time limit); where the host-map search applies (docs/planner.md 4b) the portfolio gets "
        "30% of it and the search the rest; on a reduced grid (3b) the critical-cycle search (4d) then "
        "gets twice it.",
    )
    cpsat_max_ops: int = Field(
        default=8000, ge=0, description="Largest model (ops per iteration) given to CP-SAT; larger: greedy."
    )
    ray_address: str | None = Field(
        default=None,
        description="Default of `recycle precompute --ray`: the Ray cluster to plan on (auto, HOST:PORT or "
        "ray://HOST:PORT); unset or empty: local processes. `recycle serve` runs its background solves "
        "(refinement, precompute) there too (docs/service.md).",
    )

    @property
    def solver_time_limit(self) -> timedelta:
        """`solver_time_limit_s` as a timedelta."""
        return timedelta(seconds=self.solver_time_limit_s)

    @property
    def greedy_budget(self) -> timedelta:
        """`greedy_budget_s` as a timedelta."""
        return timedelta(seconds=self.greedy_budget_s)


def planner_settings() -> PlannerSettings:
    """The planner settings from the environment now (cheap; not cached, so tests can set variables)."""
    return load_settings(PlannerSettings)


def load_settings(cls: type[S], **overrides: object) -> S:
    """`cls(**overrides)`, the rest from the environment; a bad value is an InvalidInputError naming
    the variable (or the field an override set)."""
    try:
        return cls(**overrides)  # type: ignore[arg-type]  # field values, checked by the model
    except ValidationError as exc:
        prefix = str(cls.model_config.get("env_prefix", "")).upper()
        problems = "; ".join(
            f"{prefix}{'.'.join(str(p) for p in e['loc']).upper()} ({'.'.join(str(p) for p in e['loc'])}): "
            f"{e['msg']}"
            for e in exc.errors()
        )
        raise InvalidInputError(f"bad environment variable: {problems}") from None


def environment_rows(*classes: type[BaseSettings]) -> list[tuple[str, str, str]]:
    """(variable, default, description) of every field of the given settings classes, in order: the
    one source for `recycle --help` and docs/configuration.md."""
    rows = []
    for cls in classes:
        prefix = str(cls.model_config.get("env_prefix", ""))
        for name, field in cls.model_fields.items():
            default = "unset" if field.default is None else str(field.default)
            rows.append(((prefix + name).upper(), default, field.description or ""))
    return rows


def environment_markdown(*classes: type[BaseSettings]) -> str:
    """The variables of `classes` as a Markdown table."""
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{var}` | {default} | {text} |" for var, default, text in environment_rows(*classes)]
    return "\n".join(lines) + "\n"
