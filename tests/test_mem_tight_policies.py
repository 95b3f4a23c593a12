"""The tight-memory greedy policies (planner/adaptive/tight.py, docs/planner.md section 4e): their
orders are valid schedules within the memory capacity on random jobs, without `f_first` they are
the default list scheduler's knobs, the portfolio's tight path (policies, hill-climb, critical-cycle
search) returns valid schedules, and on the -mem1x instances they beat every policy the portfolio had
before them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.adaptive.greedy import GreedyOptions
from planner.adaptive.lookahead import round_trips_covered, run_policy
from planner.adaptive.tight import STEP, TIGHT, TightOptions, neighbours, run_tight
from planner.bounds import memory_bound
from planner.contract import FailureScenario, JobSpec
from planner.normalize import normalize
from planner.orders import to_schedule
from planner.portfolio import LOOKAHEAD, PORTFOLIO, host_variants, plan_greedy
from planner.problem import Problem
from planner.simulator import validate
from tests.strategies import recoverable_scenarios, small_jobs

EXAMPLES = Path(__file__).parents[1] / "examples"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), opts=st.sampled_from(TIGHT), f_first=st.booleans())
def test_tight_orders_are_valid(data: st.DataObject, opts: GreedyOptions, f_first: bool) -> None:
    job = data.draw(small_jobs(max_d=4, max_p=4, max_m=5))
    scenario = data.draw(recoverable_scenarios(job))
    problem = Problem.build(job, scenario)
    knobs = {f.name: getattr(opts, f.name) for f in GreedyOptions.__dataclass_fields__.values()}
    run = run_tight(problem, TightOptions(**{**knobs, "num_iterations": 3}, f_first=f_first))
    floor = memory_bound(job, scenario)
    for orders in run.orders_by_iteration:
        sched = to_schedule(problem, orders, strategy="recycle-greedy")
        report = validate(job, scenario, sched)  # structure, deadlock, memory, claim
        cap = job.capacity_mib(0)
        if cap is not None:
            assert max(report.peak_memory_by_stage) <= cap * (1 + 1e-9)
        assert sched.iteration_time_ms >= floor * (1 - 1e-9)


def test_f_first_off_is_the_lookahead_policy() -> None:
    """Without f_first (and b_patience 0) the tight scheduler is the default list scheduler."""
    job = JobSpec.model_validate_json((EXAMPLES / "gpt3-6.7b-p8d4-mem1x.json").read_text())
    problem = Problem.build(job, FailureScenario(failed=[(1, 0)]))
    opts = GreedyOptions(num_iterations=3, w_patience=0.3, inflight_extra=1)
    tight = TightOptions(num_iterations=3, w_patience=0.3, inflight_extra=1)
    assert run_tight(problem, tight).orders_by_iteration == run_policy(problem, opts).orders_by_iteration


def _best_ratio(job: JobSpec, problem: Problem, runs: list[list[dict]]) -> float:  # type: ignore[type-arg]
    mb = memory_bound(job, problem.scenario)
    times = [to_schedule(problem, o, strategy="x").iteration_time_ms for run in runs for o in run]
    return min(times) / mb


def _case(instance: str, failed: list[tuple[int, int]]) -> tuple[JobSpec, Problem]:
    job = JobSpec.model_validate_json((EXAMPLES / f"{instance}.json").read_text())
    scenario = normalize(job, FailureScenario(failed=failed)).scenario
    return job, host_variants(job, scenario)[0]


@pytest.mark.timeout(120)
def test_f_first_closes_most_of_13b_stage0_gap() -> None:
    """13b-mem1x [1,0], same knobs: f_first 1.0104x the memory-aware bound, without it 1.0227x."""
    job, problem = _case("gpt3-13b-p8d8-mem1x", [(1, 0)])
    off_opts = TightOptions(num_iterations=6, w_patience=0.3, inflight_extra=0)
    on_opts = replace(off_opts, f_first=True)
    on = _best_ratio(job, problem, [run_tight(problem, on_opts).orders_by_iteration])
    off = _best_ratio(job, problem, [run_tight(problem, off_opts).orders_by_iteration])
    assert on < off - 0.005
    assert on < 1.015


@pytest.mark.timeout(120)
def test_tight_portfolio_beats_the_old_one_on_6_7b_stage0() -> None:
    """6.7b-mem1x [1,0] on the first host map: the old portfolio's policies reach 1.027x the
    memory-aware bound at best, the first tight policy 1.008x."""
    job, problem = _case("gpt3-6.7b-p8d4-mem1x", [(1, 0)])
    old = [
        run_policy(problem, replace(o, num_iterations=6)).orders_by_iteration
        for o in (*PORTFOLIO, *LOOKAHEAD)
    ]
    new = run_tight(problem, TightOptions(num_iterations=6, w_patience=0.45, inflight_extra=1))
    assert TightOptions(w_patience=0.45, inflight_extra=1) in TIGHT
    assert _best_ratio(job, problem, [new.orders_by_iteration]) < _best_ratio(job, problem, old) - 0.01


@settings(max_examples=40, deadline=None)
@given(opts=st.sampled_from(TIGHT))
def test_neighbours_are_one_step_away(opts: GreedyOptions) -> None:
    """Each neighbour differs from `opts` in exactly one knob, by one step (tight.py `neighbours`)."""
    base = {f: getattr(opts, f) for f in TightOptions.__dataclass_fields__ if hasattr(opts, f)}
    near = neighbours(opts)
    assert len(near) == len(set(near))
    for n in near:
        changed = [
            f for f in TightOptions.__dataclass_fields__ if getattr(n, f) != base.get(f, getattr(n, f))
        ]
        changed += [f for f in ("b_patience", "f_first") if f not in base and getattr(n, f) != 0]
        assert len(changed) == 1, (opts, n)
        f = changed[0]
        if f in ("w_patience", "b_patience"):
            assert abs(getattr(n, f) - getattr(opts, f, 0.0)) == pytest.approx(STEP)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tight_portfolio_plans_are_valid(data: st.DataObject) -> None:
    """plan_greedy on random jobs whose memory does not cover every round trip (TIGHT, hill-climb,
    critical-cycle search): a valid schedule within capacity, never above the default policy's."""
    job = data.draw(small_jobs(max_d=3, max_p=4, max_m=5))
    scenario = data.draw(recoverable_scenarios(job))
    problem = Problem.build(job, scenario)
    assume(not round_trips_covered(problem.job, problem.scenario))
    target = memory_bound(job, scenario)
    best = plan_greedy(job, scenario, target_ms=target, budget_s=0.5, problems=[problem])
    validate(job, scenario, best.schedule)
    default = run_policy(problem, GreedyOptions(num_iterations=6)).orders_by_iteration
    floor = min(to_schedule(problem, o, strategy="x").iteration_time_ms for o in default)
    assert target * (1 - 1e-9) <= best.schedule.iteration_time_ms <= floor + 1e-6
