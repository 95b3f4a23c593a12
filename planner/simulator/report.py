"""The validator: replay + memory capacity + claimed iteration time, and the figures of a schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from planner.bounds import load_bound
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import ScheduleRuleError
from planner.simulator.engine import Replay, WorkerKey, replay
from planner.simulator.steady import k_figure, nearest_k_figure

CLAIM_TOLERANCE = 1e-6  # relative (times max(1, T)) slack on the claimed iteration time
MEMORY_TOLERANCE = 1e-9  # relative slack on the capacity, for float sums that land exactly on it


@dataclass
class ValidationReport:
    """Figures of a valid schedule. Worker keys are (d, s)."""

    iteration_time_ms: float
    lower_bound_ms: float  # planner.bounds.load_bound(job, scenario)
    gap: float  # iteration_time / lower_bound - 1
    bubble_ratio: float  # 1 - sum(busy per iteration) / (num alive workers * iteration_time)
    peak_memory_mib: dict[WorkerKey, float]
    peak_memory_by_stage: list[float]  # max over the stage's alive workers
    capacity_by_stage: list[float | None]
    num_iterations: int
    k_iteration_ms: float  # the K-iteration figure (K = num_iterations) the steady state is the limit of
    steady_period: int  # the OPT ends repeat every this many iterations (0: not settled within the cap)
    steady_iterations: int  # iterations replayed to find the steady state

    @property
    def drift(self) -> float:
        """How far the K-iteration figure is from the steady state: steady / K-figure - 1."""
        k = self.k_iteration_ms
        return self.iteration_time_ms / k - 1 if k > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: worker keys as "d,s", non-finite numbers as None."""

        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "iteration_time_ms": self.iteration_time_ms,
            "lower_bound_ms": self.lower_bound_ms,
            "gap": num(self.gap),
            "bubble_ratio": self.bubble_ratio,
            "peak_memory_mib": {f"{d},{s}": v for (d, s), v in sorted(self.peak_memory_mib.items())},
            "peak_memory_by_stage": list(self.peak_memory_by_stage),
            "capacity_by_stage": list(self.capacity_by_stage),
            "num_iterations": self.num_iterations,
            "k_iteration_ms": self.k_iteration_ms,
            "drift": self.drift,
            "steady_period": self.steady_period,
            "steady_iterations": self.steady_iterations,
        }


def capacity_breach(job: JobSpec, peaks: dict[WorkerKey, float]) -> str | None:
    """What the memory rule says of the first worker (by pipeline, stage) whose peak is over its
    stage's capacity; None when every peak fits."""
    for (d, s), peak in sorted(peaks.items()):
        cap = job.capacity_mib(s)
        if cap is not None and peak > cap * (1 + MEMORY_TOLERANCE) + MEMORY_TOLERANCE:
            return (
                f"worker [{d}, {s}] peaks at {peak:.3f} MiB, over the capacity of {cap:.3f} MiB at stage {s}"
            )
    return None


def check_capacity(job: JobSpec, peaks: dict[WorkerKey, float]) -> None:
    """Raise ScheduleRuleError("memory") with `capacity_breach`'s words when a peak is over."""
    breach = capacity_breach(job, peaks)
    if breach is not None:
        raise ScheduleRuleError("memory", breach)


def validate(
    job: JobSpec,
    scenario: FailureScenario,
    schedule: Schedule,
    num_iterations: int = 4,
    check_claim: bool = True,
) -> ValidationReport:
    """Validate a schedule against CONTRACT.md sections 3 and 4 and return its figures.

    The iteration time is the steady state (planner/simulator/steady.py); the figure at
    K = `num_iterations` is reported beside it (`k_iteration_ms`, `drift`).

    Raises ScheduleRuleError: any structure rule or 'deadlock' (from the replay), 'memory' when a
    worker's peak exceeds its stage's capacity (or the schedule's `partition` leaves a stage less
    than nothing for activations), 'claim' when `check_claim` and the schedule's
    iteration_time_ms differs from the steady state by more than 1e-6 * max(1, T) ms. A schedule
    that names the K it was measured with (`replay_iterations`, the convention before steady-state
    claims) may instead claim the figure at that K; one that names none may claim the figure at any
    K >= 4 (CONTRACT.md section 4 defines the iteration time with K at least 4).
    """
    if schedule.partition_ranges() is not None:  # re-partitioned (issue 12): its stage-level job
        from planner.partition import job_for_schedule
        from planner.partition.derive import PartitionMemoryError

        try:
            job = job_for_schedule(job, schedule)
        except PartitionMemoryError as exc:  # the schedule's layer map does not fit: a memory breach
            raise ScheduleRuleError("memory", f"partition: {exc}") from None
    result = replay(job, scenario, schedule, num_iterations=num_iterations)
    num_p = job.num_stages
    capacity = [job.capacity_mib(s) for s in range(num_p)]
    check_capacity(job, result.peak_memory_mib)
    t = result.iteration_time_ms
    if check_claim:
        _check_claim(schedule, result)
    bound = load_bound(job, scenario)
    gap = t / bound - 1 if bound > 0 else (0.0 if t <= 0 else math.inf)
    busy = sum(result.busy_ms.values())
    bubble = 1 - busy / (len(result.busy_ms) * t) if t > 0 else 0.0
    by_stage = [0.0] * num_p
    for (_, s), peak in result.peak_memory_mib.items():
        by_stage[s] = max(by_stage[s], peak)
    return ValidationReport(
        iteration_time_ms=t,
        lower_bound_ms=bound,
        gap=gap,
        bubble_ratio=bubble,
        peak_memory_mib=dict(result.peak_memory_mib),
        peak_memory_by_stage=by_stage,
        capacity_by_stage=capacity,
        num_iterations=result.num_iterations,
        k_iteration_ms=result.k_iteration_ms,
        steady_period=result.steady.period,
        steady_iterations=result.steady.iterations,
    )


def _close(claimed: float, t: float) -> bool:
    return abs(claimed - t) <= CLAIM_TOLERANCE * max(1.0, abs(t))


def _check_claim(schedule: Schedule, result: Replay) -> None:
    """The claim is the steady state, or the K-iteration figure of CONTRACT.md section 4 for the K
    the document names (`replay_iterations`) or, when it names none, for any K >= 4: a schedule
    whose author replayed K = 4 by the contract's definition is valid (its drift is reported)."""
    claimed, steady = schedule.iteration_time_ms, result.iteration_time_ms
    if _close(claimed, steady):
        return
    ends, named = result.replayed_opt_end_ms, schedule.replay_iterations
    if named is not None:
        at_named = k_figure(ends, result.steady, named)
        if at_named is not None and _close(claimed, at_named):
            return  # a K-iteration claim that says which K
    else:
        near = nearest_k_figure(ends, result.steady, claimed)
        if near is not None and _close(claimed, near[1]):
            return
    k = named or 4
    fig = k_figure(ends, result.steady, k)
    also = f" (and {fig!r} at K={k})" if fig is not None and not _close(fig, steady) else ""
    raise ScheduleRuleError(
        "claim",
        f"schedule claims iteration_time_ms {claimed!r} but the replay's steady state is {steady!r}{also}",
    )
