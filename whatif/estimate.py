"""Cheap stand-ins for recycle plans, so `recycle simulate` never waits for the planner.

A recycle plan of a 256-worker job takes 5-20 s of greedy search; `recycle simulate` meets a new
failure set at almost every failure. When the plan cache (`--plans DIR`) holds the set's plan, the
plan is used; otherwise its iteration time is ESTIMATED by the memory-aware lower bound
(planner.bounds.memory_bound: the per-worker load bound plus the warm-up idle a worker cannot avoid
under its memory capacity). It costs about a millisecond, where even one greedy run on gpt3-175b
costs seconds, and on the shipped instances the planner's greedy plans sit at or just above it
(median 0.0%, mean under 0.3%, worst 2.7% above on a tight-memory 6.7b case; docs/whatif.md).
Being a lower bound, the estimate can only be optimistic: it never makes recycle look slower.

recycle+barrier needs the cold-start makespan of the plan instead (an iteration that starts from an
empty pipeline). Its estimate is the cold-start makespan of ZB-H1 on the same failure set (what
reroute+decoupled runs, replayed anyway, whatif/structured.py), and at least the iteration-time
estimate: the planner's orders with a barrier land near it (+0.1% to -4% on the shipped jobs).

Estimates are labelled (`estimated: True`, `method`) and never written to the plan cache.
"""

from __future__ import annotations

from typing import Any

from planner.bounds import load_bound, memory_bound
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError
from planner.normalize import normalize
from planner.reduced import reduce_job
from whatif.strategies.base import lost_stages

ESTIMATE_METHOD = "memory-aware bound"
# How far above the estimate a plan may land on the shipped instances (measured; docs/whatif.md).
ESTIMATE_TOLERANCE = 0.03


def barrier_estimate_ms(job: JobSpec, scenario: FailureScenario, iteration_ms: float) -> float:
    """ZB-H1's cold-start makespan on (job, scenario), and at least `iteration_ms`."""
    from whatif.structured import baseline_times

    try:
        _, cold_ms = baseline_times("zb-h1", job, scenario, check_memory=False)
    except InvalidInputError:
        return iteration_ms
    return max(iteration_ms, cold_ms)


def estimate_record(job: JobSpec, scenario: FailureScenario, with_barrier: bool = False) -> dict[str, Any]:
    """A plan-cache-shaped record for `scenario` whose figures are estimates (module docstring).

    `with_barrier` also estimates `barrier_ms` (one ZB-H1 replay on a reduced grid); otherwise
    `barrier_ms` is the iteration-time estimate, a lower bound on it."""
    norm = normalize(job, scenario)
    record: dict[str, Any] = {
        "key": norm.key,
        "job": job.name,
        "scenario": norm.scenario.model_dump(mode="json"),
        "estimated": True,
        "method": ESTIMATE_METHOD,
    }
    lost = lost_stages(job, norm.scenario)
    if lost:
        return {**record, "unrecoverable": True, "stages": lost}
    # The reduced grid (planner/reduced.py) has the same bounds and costs a fraction on large grids.
    red = reduce_job(job, norm.scenario)
    small = job if red is None else red.job
    mb = memory_bound(small, norm.scenario)
    barrier = barrier_estimate_ms(job, norm.scenario, mb) if with_barrier else mb
    return {
        **record,
        "unrecoverable": False,
        "iteration_time_ms": mb,
        "barrier_ms": barrier,
        "lower_bound_ms": load_bound(small, norm.scenario),
        "memory_bound_ms": mb,
    }


def estimate_of(record: dict[str, Any]) -> float | None:
    """What the estimate is for a planned record (its stored memory-aware bound), None if unknown."""
    if record.get("unrecoverable") or record.get("estimated"):
        return None
    value = record.get("memory_bound_ms")
    return float(value) if isinstance(value, (int, float)) else None
