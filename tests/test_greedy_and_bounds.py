"""The greedy list scheduler and the lower bounds, on tiny jobs computed by hand."""

from __future__ import annotations

import pytest

from planner.adaptive.greedy import GreedyOptions, run_greedy
from planner.bounds import allocate_stage, load_bound, memory_bound
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError
from planner.orders import to_schedule
from planner.plan import plan
from planner.problem import Problem
from planner.simulator import validate
from tests import jobs


def uniform_job(D: int, P: int, M: int, cap: float | None = None, ar: float = 0.0) -> JobSpec:
    return jobs.uniform_job(D, P, M, capacity_mib=cap, allreduce_ms=ar)


def test_load_bound_by_hand() -> None:
    job = uniform_job(3, 2, 4, ar=0.5)
    # Failure-free: 4 micro-batches x (F+B+W = 3 ms) + all-reduce 0.5 + optimizer 1 = 13.5 ms.
    assert load_bound(job, FailureScenario()) == pytest.approx(13.5)
    # Worker [1,0] failed: 12 micro-batches over 2 peers -> 6 each: 18 + 1.5 = 19.5 ms.
    assert load_bound(job, FailureScenario(failed=[(1, 0)])) == pytest.approx(19.5)
    # ... and peer [0,0] twice as slow: 12 = 4 + 8 (periods 4*3*2 = 24 vs 8*3 = 24), OPT 2 vs 1.
    slow = FailureScenario(failed=[(1, 0)], slow=[{"worker": (0, 0), "factor": 2.0}])
    alloc = allocate_stage(job, slow, 0)
    assert alloc.counts == {0: 4, 2: 8}
    assert load_bound(job, slow) == pytest.approx(24 + 0.5 + 2.0)


def test_memory_bound_adds_warmup_idle() -> None:
    # P=3, capacity for one activation plus a little: stage 0 can run one F before its first B,
    # whose round trip is F0 + (F+B) at stages 1 and 2 = 5 ms; idle >= 5 - 1 = 4 ms per iteration.
    job = uniform_job(1, 3, 4, cap=130.0)
    assert memory_bound(job, FailureScenario()) == pytest.approx(load_bound(job, FailureScenario()) + 4.0)
    # Without a capacity all 4 Fs run before the first B: they cover 4 of the 5 ms, 1 ms idle (the
    # round-trip term gives the same 14 ms: tests/test_bounds_roundtrip.py); with 5 Fs none.
    unlimited = uniform_job(1, 3, 4)
    assert memory_bound(unlimited, FailureScenario()) == pytest.approx(
        load_bound(unlimited, FailureScenario()) + 1
    )
    plenty = uniform_job(1, 3, 5)
    assert memory_bound(plenty, FailureScenario()) == load_bound(plenty, FailureScenario())


@pytest.mark.parametrize(("D", "P", "M"), [(1, 2, 4), (2, 2, 4), (2, 3, 6), (3, 4, 8)])
def test_greedy_reaches_the_load_bound_with_ample_memory(D: int, P: int, M: int) -> None:
    job = uniform_job(D, P, M)
    result = plan(job, FailureScenario(), use_cpsat=False)
    assert result.iteration_time_ms == pytest.approx(load_bound(job, FailureScenario()))


def test_greedy_absorbs_a_failure_when_work_divides_evenly() -> None:
    job = uniform_job(3, 3, 4)
    scenario = FailureScenario(failed=[(2, 1)])  # stage 1: 12 micro-batches over 2 peers
    result = plan(job, scenario, use_cpsat=False)
    assert result.iteration_time_ms == pytest.approx(load_bound(job, scenario))  # 6*3 + 1 = 19
    validate(job, scenario, result.schedule)


def test_greedy_orders_respect_memory_capacity() -> None:
    job = uniform_job(2, 3, 6, cap=260.0)  # two activations, or one plus two deferred Ws
    problem = Problem.build(job, FailureScenario(failed=[(0, 2)]))
    for opts in (GreedyOptions(), GreedyOptions(w_patience=1.0)):
        for orders in run_greedy(problem, opts).orders_by_iteration:
            schedule = to_schedule(problem, orders, strategy="test")
            report = validate(job, problem.scenario, schedule)
            assert max(report.peak_memory_by_stage) <= 260.0


def test_capacity_below_one_activation_is_refused_naming_the_stage() -> None:
    job = uniform_job(2, 2, 2, cap=50.0)
    with pytest.raises(InvalidInputError, match="stage 0"):
        plan(job, FailureScenario(), use_cpsat=False)


@pytest.mark.parametrize(("act", "wg", "failed"), [(60.0, 150.0, []), (45.0, 60.0, [(0, 1)])])
def test_a_weight_gradient_that_would_not_fit_fuses_its_backward(
    act: float, wg: float, failed: list[tuple[int, int]]
) -> None:
    """A B turns an activation into a weight gradient: where that is larger and would not fit, the
    greedy ran the B anyway and the plan was refused ([memory] 150 over 100) though the fused BW,
    which ends holding neither, fits. CP-SAT (B and W only) is skipped for such orders."""
    job = jobs.uniform_job(2, 2, 4, activation_mib=act, weight_grad_mib=wg, capacity_mib=100.0)
    scenario = FailureScenario(failed=failed)
    result = plan(job, scenario)
    report = validate(job, scenario, result.schedule)
    assert max(report.peak_memory_mib.values()) <= 100.0
    assert any(a.op == "BW" for w in result.schedule.workers for a in w.actions)
    assert result.cpsat["status"] == "SKIPPED" and "BW" in str(result.cpsat["reason"])
