"""CP-SAT memory family: capacity below one activation is infeasible; a tight one is respected."""

from __future__ import annotations

import datetime

from planner.cpsat import SolveStatus, improve_orders
from planner.cpsat.build import BuildOptions, build_model
from planner.cpsat.simple_hint import gpipe_orders
from planner.cpsat.solve import solve
from planner.cpsat.variables import Orders
from planner.orders import to_schedule
from planner.problem import Problem
from planner.simulator import validate
from tests.test_cpsat_precedence import tiny_problem

LIMIT = datetime.timedelta(seconds=3)


def test_capacity_below_one_activation_is_infeasible() -> None:
    prob = tiny_problem(capacity=99.0)  # activation_mib is 100
    v = build_model(prob, BuildOptions(horizon_ms=200.0))
    assert solve(v, LIMIT).status is SolveStatus.INFEASIBLE


def test_tight_capacity_is_respected_by_the_replay() -> None:
    # room for one activation plus one deferred weight gradient per worker
    prob = tiny_problem(capacity=130.0, m=3)
    out = improve_orders(prob, _one_at_a_time(prob), LIMIT, lower_bound_ms=0.0)
    assert out.status.has_solution() and out.orders is not None
    report = validate(prob.job, prob.scenario, to_schedule(prob, out.orders, "cpsat"))
    assert max(report.peak_memory_mib.values()) <= 130.0
    # unlimited memory lets GPipe-like overlap pay off: the capped period is no better
    free = tiny_problem(m=3)
    uncapped = improve_orders(free, gpipe_orders(free), LIMIT, lower_bound_ms=0.0)
    assert uncapped.period_ms is not None and out.period_ms is not None
    assert uncapped.period_ms <= out.period_ms + 1e-9


def _one_at_a_time(prob: Problem) -> Orders:
    """F, B, W of one micro-batch before the next F: one activation live per worker at a time.
    Deadlock-free here because every pipeline keeps its own micro-batches (no failure)."""
    return {
        (d, s): [e for mb in prob.microbatches_on(d, s) for e in (("F", mb), ("B", mb), ("W", mb))]
        + [("OPT", None)]
        for d, s in prob.workers()
    }
