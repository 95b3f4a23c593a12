"""Baseline schedule generators the adaptive planner is compared against.

Each baseline is a pair of pure functions: `build_problem(job, scenario) -> Problem` (which hosts
run which micro-batches) and `build_orders(problem) -> Orders` (each alive worker's order for one
iteration). Timing is the simulator's job: `baseline_schedule` replays the orders through
`planner.orders.to_schedule`, which raises ScheduleRuleError if they deadlock.

- gpipe:           all F, then all BW, then OPT (naive re-route hosts under failures).
- 1f1b:            classic 1F1B with fused BW; under failures identical to naive-reroute.
- zb-h1:           ZB-H1: 1F1B skeleton with split B / W, W deferred into the drain bubbles.
- naive-reroute:   failed workers' micro-batches dealt round-robin to peers, 1F1B over all hosted.
- 1f1b-survivors:  drop every pipeline that lost a worker; survivors take its micro-batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from planner.baselines import gpipe, naive_reroute, one_f_one_b, survivors, zero_bubble
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import InvalidInputError
from planner.orders import Orders, to_schedule
from planner.problem import Problem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Baseline:
    """A baseline: how it hosts micro-batches, and how it orders each worker's ops."""

    name: str
    summary: str
    build_problem: Callable[[JobSpec, FailureScenario], Problem]
    build_orders: Callable[[Problem], Orders]


BASELINES: dict[str, Baseline] = {
    b.name: b
    for b in (
        Baseline("gpipe", "all F, then all fused BW, then OPT", gpipe.build_problem, gpipe.build_orders),
        Baseline(
            "1f1b",
            "one-forward-one-backward, fused BW (naive re-route under failures)",
            one_f_one_b.build_problem,
            one_f_one_b.build_orders,
        ),
        Baseline(
            "zb-h1",
            "zero-bubble ZB-H1: 1F1B memory, split B/W, W deferred into bubbles",
            zero_bubble.build_problem,
            zero_bubble.build_orders,
        ),
        Baseline(
            "naive-reroute",
            "failed workers' micro-batches round-robin to alive peers, 1F1B over all hosted",
            naive_reroute.build_problem,
            naive_reroute.build_orders,
        ),
        Baseline(
            "1f1b-survivors",
            "drop pipelines that lost a worker; fully-alive pipelines take their micro-batches",
            survivors.build_problem,
            survivors.build_orders,
        ),
    )
}


def baseline_schedule(name: str, job: JobSpec, scenario: FailureScenario) -> Schedule:
    """The schedule baseline `name` runs for (job, scenario), with the simulator's times on it.

    Raises InvalidInputError for an unknown name or a baseline that cannot apply to the scenario,
    UnrecoverableScenarioError when some stage has no alive worker.
    """
    baseline = BASELINES.get(name)
    if baseline is None:
        raise InvalidInputError(f"unknown baseline {name!r}; known: {', '.join(sorted(BASELINES))}")
    problem = baseline.build_problem(job, scenario)
    orders = baseline.build_orders(problem)
    logger.debug("baseline %s: %d ops over %d workers", name, sum(map(len, orders.values())), len(orders))
    return to_schedule(problem, orders, strategy=name)


__all__ = ["BASELINES", "Baseline", "baseline_schedule"]
