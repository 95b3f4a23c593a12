"""CP-SAT symmetry family: relabelling within route groups is a pure renaming."""

from __future__ import annotations

import datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cpsat.build import BuildOptions, build_model
from planner.cpsat.hint import hint_times
from planner.cpsat.simple_hint import gpipe_orders
from planner.cpsat.solve import solve
from planner.cpsat.symmetry import canonical_orders, route_groups
from planner.cpsat.timing import IntTiming
from tests.test_cpsat_precedence import tiny_problem


def test_route_groups_split_rerouted_micro_batches() -> None:
    prob = tiny_problem(failed=[(1, 1)], m=2)
    groups = route_groups(prob)
    routes = {tuple(prob.host[s, d, m] for s in range(2)) for g in groups for d, m in g}
    assert (0, 0) in routes
    for g in groups:
        assert len({tuple(prob.host[s, d, m] for s in range(2)) for d, m in g}) == 1


@settings(max_examples=15, deadline=None)
@given(st.permutations(range(3)))
def test_canonical_orders_keep_the_period(perm: list[int]) -> None:
    prob = tiny_problem(m=3)
    base = gpipe_orders(prob)
    shuffled = {
        w: [(op, (mb[0], perm[mb[1]]) if mb is not None else None) for op, mb in entries]
        for w, entries in base.items()
    }
    canon = canonical_orders(prob, shuffled)
    timing = IntTiming(prob)
    assert hint_times(prob, canon, timing).period == hint_times(prob, shuffled, timing).period
    first = [mb for op, mb in canon[0, 0] if op == "F" and mb is not None]
    assert first == sorted(first, key=lambda mb: (mb[1], mb[0]))


def test_symmetry_breaking_keeps_the_optimum() -> None:
    prob = tiny_problem(d=1, p=2, m=2)
    limit = datetime.timedelta(seconds=5)
    periods = []
    for sym in (False, True):
        v = build_model(prob, BuildOptions(horizon_ms=100.0, symmetry=sym, scale=10))
        # the production parameters favour finding solutions; proving needs CP-SAT's LP back
        res = solve(v, limit, linearization_level=2, use_precedences_in_disjunctive_constraint=True)
        assert res.status.name == "OPTIMAL"
        periods.append(res.objective)
    assert periods[0] == periods[1]
