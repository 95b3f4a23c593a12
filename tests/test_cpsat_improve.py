"""improve_orders end to end: its orders replay valid, the replay is no slower than the model's T
or the hint, and the bound is at least the load bound; a deadlocking hint is refused."""

from __future__ import annotations

import datetime

import pytest

from planner.bounds import load_bound
from planner.cpsat import improve_orders
from planner.cpsat.decompose import stages_to_reoptimise
from planner.cpsat.simple_hint import gpipe_orders
from planner.errors import ScheduleRuleError
from planner.orders import to_schedule
from planner.simulator import validate
from tests.test_cpsat_precedence import tiny_problem

LIMIT = datetime.timedelta(seconds=3)


@pytest.mark.parametrize("failed", [[], [(1, 1)], [(0, 0), (1, 2)]])
def test_improved_orders_replay_valid(failed: list[tuple[int, int]]) -> None:
    prob = tiny_problem(failed=failed, d=2, p=3, m=3)
    lb = load_bound(prob.job, prob.scenario)
    hint = gpipe_orders(prob)
    seen: list[tuple[float, float, float]] = []
    out = improve_orders(prob, hint, LIMIT, lb, progress=lambda *a: seen.append(a))
    assert out.orders is not None and out.period_ms is not None
    assert lb - 1e-9 <= out.bound_ms <= out.period_ms + 1e-9
    hint_report = validate(prob.job, prob.scenario, to_schedule(prob, hint, "gpipe"))
    report = validate(prob.job, prob.scenario, to_schedule(prob, out.orders, "cpsat"))
    assert report.iteration_time_ms <= out.period_ms + 1e-6
    assert report.iteration_time_ms <= hint_report.iteration_time_ms + 1e-6
    assert seen and seen[0][1] >= out.period_ms - 1e-9


def test_decomposition_keeps_frozen_workers_and_replays_valid() -> None:
    prob = tiny_problem(failed=[(1, 2)], d=2, p=4, m=2)
    stages = stages_to_reoptimise(prob, radius=0)
    assert stages == [2]
    hint = gpipe_orders(prob)
    out = improve_orders(prob, hint, LIMIT, load_bound(prob.job, prob.scenario), stages=stages)
    assert out.orders is not None
    for w, order in hint.items():
        if w[1] != 2:
            assert out.orders[w] == order
    validate(prob.job, prob.scenario, to_schedule(prob, out.orders, "cpsat"))


def test_deadlocking_hint_is_refused() -> None:
    prob = tiny_problem(d=1, p=2, m=1)
    hint = {
        (0, 0): [("F", (0, 0)), ("W", (0, 0)), ("B", (0, 0)), ("OPT", None)],
        (0, 1): [("F", (0, 0)), ("B", (0, 0)), ("W", (0, 0)), ("OPT", None)],
    }
    with pytest.raises(ScheduleRuleError):
        improve_orders(prob, hint, LIMIT, 0.0)
