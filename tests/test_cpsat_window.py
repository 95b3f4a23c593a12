"""CP-SAT window/no-overlap/optimizer families: T below the load bound is infeasible; a solution keeps
each worker's ops apart, each OPT after every peer's W plus the all-reduce, inside [anchor, anchor+T]."""

from __future__ import annotations

import datetime
import itertools

from planner.bounds import load_bound
from planner.cpsat import SolveStatus
from planner.cpsat.build import BuildOptions, build_model
from planner.cpsat.extract import extract_period_ms, extract_starts_ms
from planner.cpsat.solve import solve
from tests.test_cpsat_precedence import tiny_problem

LIMIT = datetime.timedelta(seconds=2)
DUR = {"F": 1.0, "B": 2.0, "W": 1.5, "OPT": 0.5}


def test_period_below_the_load_bound_is_infeasible() -> None:
    prob = tiny_problem(failed=[(1, 0)])
    lb = load_bound(prob.job, prob.scenario)
    v = build_model(prob, BuildOptions(horizon_ms=200.0, max_period_ms=lb - 0.01))
    assert solve(v, LIMIT).status is SolveStatus.INFEASIBLE


def test_solution_keeps_workers_sequential_and_opt_after_all_reduce() -> None:
    prob = tiny_problem(failed=[(1, 0)], allreduce=2.0)
    lb = load_bound(prob.job, prob.scenario)
    v = build_model(prob, BuildOptions(horizon_ms=200.0, lower_bound_ms=lb))
    res = solve(v, LIMIT)
    assert res.status.has_solution()
    start = extract_starts_ms(v, res.solver)
    period = extract_period_ms(v, res.solver)
    assert period >= lb - 1e-9
    for w in prob.workers():
        spans = sorted((t, t + DUR[k[3]]) for k, t in start.items() if (k[0], k[1]) == w)
        for (_, end_a), (start_b, _) in itertools.pairwise(spans):
            assert start_b >= end_a - 1e-9
        assert spans[-1][1] - spans[0][0] <= period + 1e-9  # window
        last_w = max(t + DUR["W"] for k, t in start.items() if k[1] == w[1] and k[3] == "W")
        assert start[w[0], w[1], None, "OPT"] >= last_w + 2.0 - 1e-9
