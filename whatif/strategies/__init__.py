"""Strategy models: each maps a failure set to a steady iteration time (or fatal), see base.py.

`make_strategies` builds the standard line-up in table order, sharing one plan cache and one
shrink model (checkpoint-restart without spares runs the shrink configuration after a restart).
"""

from __future__ import annotations

from datetime import timedelta

from planner.contract import JobSpec
from whatif.cache import PlanCache
from whatif.strategies.bamboo import Bamboo
from whatif.strategies.base import Costs, Outcome, Strategy, lost_stages
from whatif.strategies.checkpoint import CheckpointRestart, restart_efficiency, young_daly_interval_s
from whatif.strategies.oobleck import Oobleck
from whatif.strategies.recycle import (
    DEFAULT_PLAN_TIME_LIMIT,
    Recycle,
    RecycleBarrier,
    RerouteDecoupled,
    RerouteDecoupledStaggered,
    RerouteOnly,
    plan_record,
)
from whatif.strategies.repartition import RecycleRepartition
from whatif.strategies.shrink import Shrink

ABLATIONS = ("reroute-only", "reroute+decoupled", "reroute+decoupled+staggered", "recycle+barrier")
ALTERNATIVES = ("checkpoint-restart", "shrink", "oobleck", "bamboo")
ALL_STRATEGIES = ("recycle", *ABLATIONS, *ALTERNATIVES)  # the default line-up
# Opt-in (--strategies): it needs the job's layer count, and plans several splits per failure set.
EXTRA_STRATEGIES = ("recycle+repartition",)
KNOWN_STRATEGIES = (*ALL_STRATEGIES, *EXTRA_STRATEGIES)


def make_strategies(
    job: JobSpec,
    costs: Costs,
    cache: PlanCache | None = None,
    names: tuple[str, ...] = ALL_STRATEGIES,
    plan_time_limit: timedelta = DEFAULT_PLAN_TIME_LIMIT,
    exact: bool = True,
) -> dict[str, Strategy]:
    """The named strategy models for `job`, in the order given (ValueError for an unknown name).
    `exact` False: recycle and recycle+barrier estimate the failure sets the cache misses."""
    unknown = [n for n in names if n not in KNOWN_STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategy {unknown}; known: {', '.join(KNOWN_STRATEGIES)}")
    cache = cache or PlanCache(None)
    shrink = Shrink(job, costs, cache)
    builders = {
        "recycle": lambda: Recycle(job, costs, cache, plan_time_limit, exact),
        "recycle+barrier": lambda: RecycleBarrier(job, costs, cache, plan_time_limit, exact),
        "reroute-only": lambda: RerouteOnly(job, costs, cache),
        "reroute+decoupled": lambda: RerouteDecoupled(job, costs, cache),
        "reroute+decoupled+staggered": lambda: RerouteDecoupledStaggered(job, costs, cache),
        "checkpoint-restart": lambda: CheckpointRestart(job, costs, shrink),
        "shrink": lambda: shrink,
        "oobleck": lambda: Oobleck(job, costs),
        "bamboo": lambda: Bamboo(job, costs),
        "recycle+repartition": lambda: RecycleRepartition(job, costs, cache, plan_time_limit, exact),
    }
    return {n: builders[n]() for n in names}  # type: ignore[no-untyped-call]


__all__ = [
    "ABLATIONS",
    "ALL_STRATEGIES",
    "ALTERNATIVES",
    "EXTRA_STRATEGIES",
    "KNOWN_STRATEGIES",
    "Bamboo",
    "CheckpointRestart",
    "Costs",
    "Oobleck",
    "Outcome",
    "Recycle",
    "RecycleBarrier",
    "RecycleRepartition",
    "RerouteDecoupled",
    "RerouteDecoupledStaggered",
    "RerouteOnly",
    "Shrink",
    "Strategy",
    "lost_stages",
    "make_strategies",
    "plan_record",
    "restart_efficiency",
    "young_daly_interval_s",
]
