"""The few-micro-batch tools of issue 13 item 5: the critical-cycle search
(planner/adaptive/critical_moves.py), ZB's W placement on another generator's skeleton
(planner/adaptive/zb_delays.py `redeferred_orders`) and the reduced grid's disjoint host map
(planner/reduced.py `disjoint`). Whatever they return must validate, fit in memory, never be slower
than where they started and never beat the memory-aware bound."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.adaptive.critical_moves import critical_search, cycle_moves
from planner.adaptive.greedy import run_greedy
from planner.adaptive.zb_delays import redeferred_orders
from planner.baselines import BASELINES
from planner.bounds import load_bound, memory_bound
from planner.contract import FailureScenario
from planner.normalize import normalize
from planner.orders import to_schedule
from planner.portfolio import fits_memory as _fits_memory
from planner.problem import Problem
from planner.reduced import disjoint, reduce_job
from planner.simulator import validate
from tests.strategies import recoverable_scenarios, small_jobs
from tests.test_reduced_grid import llama3_like, llama_shaped


@pytest.mark.timeout(150)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_search_and_redeferral_keep_valid_schedules(data: st.DataObject) -> None:
    job = data.draw(small_jobs(max_d=3, max_p=4, max_m=3))
    scenario = data.draw(recoverable_scenarios(job))
    problem = Problem.build(job, scenario)
    start_orders = data.draw(
        st.sampled_from(["greedy", "zb-h1"]).map(
            lambda name: (
                run_greedy(problem).steady_orders()
                if name == "greedy"
                else BASELINES["zb-h1"].build_orders(problem)
            )
        )
    )
    start = to_schedule(problem, start_orders, strategy="start").iteration_time_ms
    fits = _fits_memory(problem, start_orders)
    # the memory-aware bound holds for schedules that fit; a start that does not (ZB-H1 on a job with
    # room for one activation) leaves the search free to overflow, and only the load bound holds
    bound = memory_bound(job, scenario) if fits else load_bound(job, scenario)
    for orders in redeferred_orders(problem, start_orders).values():
        assert _fits_memory(problem, orders) or not fits  # a fitting skeleton keeps fitting
        if fits:
            validate(job, scenario, to_schedule(problem, orders, strategy="redefer"))
    found = critical_search(problem, start_orders, start, 0.0, 1.0, _fits_memory)
    if found is None:
        return
    orders, t = found
    sched = to_schedule(problem, orders, strategy="critical")
    assert sched.iteration_time_ms == pytest.approx(t, rel=1e-9)
    if fits:
        validate(job, scenario, sched)
    assert bound * (1 - 1e-9) <= t < start
    assert _fits_memory(problem, orders) or not fits


@pytest.mark.timeout(120)
def test_search_improves_zb_h1_on_llama3_shape() -> None:
    """llama3-405b-p16d128's shape on 20 pipelines, a failure at stage 8 (reduced to 18): from
    ZB-H1, the search finds moves on the critical cycle that pay."""
    job = llama3_like(20)
    scenario = FailureScenario(failed=[(0, 8)])
    red = reduce_job(job, scenario)
    assert red is not None
    problem = disjoint(red, scenario)
    orders = BASELINES["zb-h1"].build_orders(problem)
    start = to_schedule(problem, orders, strategy="zb-h1").iteration_time_ms
    moves = cycle_moves(problem, orders)
    assert moves and all(0 <= k < idx for _, idx, k, _ in moves)
    found = critical_search(problem, orders, start, 0.0, 20.0, _fits_memory)
    assert found is not None
    bound = memory_bound(job, scenario)
    assert bound <= found[1] < start - 1.0  # 25100.3 -> 25019.5 ms (bound 23828.8)


@pytest.mark.parametrize("failed", [[(0, 1), (1, 2), (2, 3)], [(0, 1), (1, 1)], [(0, 0), (1, 3)]])
def test_disjoint_hosts_give_each_peer_extras_at_one_stage_at_most(failed: list[tuple[int, int]]) -> None:
    job = llama_shaped(60, 4)
    canonical = normalize(job, FailureScenario(failed=failed)).scenario
    red = reduce_job(job, canonical)
    assert red is not None
    problem = disjoint(red, canonical)
    touched = {d for d, _ in canonical.failed}
    extra_stages: dict[int, set[int]] = {}
    for (s, d, _), h in problem.host.items():
        if h != d:
            extra_stages.setdefault(h, set()).add(s)
    assert red.stand_in not in extra_stages
    assert all(len(stages) == 1 for h, stages in extra_stages.items() if h not in touched)
    assert memory_bound(red.job, canonical) == pytest.approx(memory_bound(job, canonical), rel=1e-12)
