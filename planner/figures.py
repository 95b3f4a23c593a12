"""Figures of a schedule that `recycle plan` and `recycle validate` share (table and --json).

A gap to a bound is `iteration time / bound - 1`. The iteration time is the simulator's steady state
(planner/simulator/steady.py), which the bounds hold for; a document that still claims a K-iteration
figure (its `replay_iterations`), or float noise, can put it a hair below (docs/planner.md, "Gaps
below zero"). The raw gaps are kept; `*_clamped` are max(0, gap) and `measured_below_bound` says
whether any raw gap was negative.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from planner.contract import FailureScenario, JobSpec, Schedule, SlowWorker

if TYPE_CHECKING:
    from planner.plan import Progress
    from planner.simulator import ValidationReport

BELOW_BOUND_TOLERANCE = 1e-9  # relative; float noise of the replay sums is far below it


def gap(value: float, bound: float) -> float:
    """Relative gap to a bound; 0 when both are 0 (a job whose every duration is 0)."""
    if bound <= 0:
        return 0.0 if value <= 0 else math.inf
    return value / bound - 1


def slow_list(slow: list[SlowWorker] | None) -> list[dict[str, Any]]:
    """Slow workers as [{"worker": [d, s], "factor": f}], sorted by worker."""
    ordered = sorted(slow or [], key=lambda sw: (int(sw.worker[0]), int(sw.worker[1])))
    return [{"worker": [int(sw.worker[0]), int(sw.worker[1])], "factor": sw.factor} for sw in ordered]


def derived_figures(
    fig: dict[str, Any],
    schedule: Schedule,
    own_failure_free_ms: float | None = None,
    slow: list[SlowWorker] | None = None,
) -> dict[str, Any]:
    """`fig` plus: slow workers, throughput_retained_vs_1f1b, clamped gaps, measured_below_bound,
    and, when given, this planner's failure-free iteration time and the throughput retained vs it.
    `slow`: the scenario's slow workers (default: the schedule's)."""
    out = dict(fig)
    t = float(fig["iteration_time_ms"])
    out["slow"] = slow_list(schedule.slow if slow is None else slow)
    if "throughput_retained" in fig:
        out["throughput_retained_vs_1f1b"] = fig["throughput_retained"]
    if own_failure_free_ms is not None:
        out["own_failure_free_ms"] = own_failure_free_ms
        out["throughput_retained_vs_own_failure_free"] = own_failure_free_ms / t if t else 1.0
    below = False
    for key in ("gap_to_lower_bound", "gap_to_memory_bound"):
        if key in fig:
            out[key + "_clamped"] = max(0.0, fig[key])
            below = below or fig[key] < -BELOW_BOUND_TOLERANCE
    out["measured_below_bound"] = below
    return out


def schedule_figures(
    job: JobSpec, scenario: FailureScenario, schedule: Schedule, report: ValidationReport
) -> dict[str, Any]:
    """What `recycle validate` can say about any schedule from the job and the schedule alone:
    bounds and gaps, throughput vs failure-free 1F1B (solver-specific figures are left out)."""
    from planner.bounds import memory_bound
    from planner.partition import job_for_schedule
    from planner.plan import baseline_1f1b_ms

    t = report.iteration_time_ms
    base = baseline_1f1b_ms(job)  # the job as given: a re-partition's gain shows in this ratio
    mb = memory_bound(job_for_schedule(job, schedule), scenario)  # the job it runs, as the load bound
    fig: dict[str, Any] = {
        "job": schedule.job,
        "failed": [list(w) for w in schedule.failed],
        "iteration_time_ms": t,
        "baseline_1f1b_ms": base,
        "throughput_retained": base / t if t else 1.0,
        "lower_bound_ms": report.lower_bound_ms,
        "memory_bound_ms": mb,
        "gap_to_lower_bound": gap(t, report.lower_bound_ms),
        "gap_to_memory_bound": gap(t, mb),
    }
    return derived_figures(fig, schedule, slow=list(scenario.slow))


_OWN_CACHE: dict[tuple[str, float, bool], float] = {}


def own_failure_free_ms(
    job: JobSpec, time_limit: timedelta, use_cpsat: bool, progress: Progress | None = None
) -> float:
    """Iteration time of this planner's own plan for `job` with no failure, same settings (cached
    per job, time limit and CP-SAT switch for the life of the process)."""
    from planner.normalize import job_fingerprint
    from planner.plan import plan

    key = (job_fingerprint(job), time_limit.total_seconds(), use_cpsat)
    if key not in _OWN_CACHE:
        result = plan(job, FailureScenario(), time_limit=time_limit, use_cpsat=use_cpsat, progress=progress)
        _OWN_CACHE[key] = result.iteration_time_ms
    return _OWN_CACHE[key]
