"""Property tests of the adaptive planner over random small jobs and failure sets."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.baselines import baseline_schedule
from planner.bounds import load_bound, memory_bound
from planner.errors import ScheduleRuleError
from planner.plan import plan
from planner.simulator import validate
from tests.strategies import recoverable_scenarios, small_jobs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_greedy_plans_are_valid_and_bounded(data: st.DataObject) -> None:
    job = data.draw(small_jobs())
    scenario = data.draw(recoverable_scenarios(job))
    result = plan(job, scenario, use_cpsat=False)
    report = validate(job, scenario, result.schedule)  # raises on any broken rule
    assert abs(report.iteration_time_ms - result.schedule.iteration_time_ms) <= 1e-6 * max(
        1.0, report.iteration_time_ms
    )
    # The bounds hold for the steady state, which is what a plan claims (docs/planner.md section 7).
    assert result.iteration_time_ms >= load_bound(job, scenario) * (1 - 1e-9)
    assert result.iteration_time_ms >= memory_bound(job, scenario) * (1 - 1e-9)
    naive = baseline_schedule("naive-reroute", job, scenario)
    try:
        validate(job, scenario, naive)
    except ScheduleRuleError as exc:  # a naive schedule over the memory capacity is no rival
        assert exc.rule == "memory"
        return
    assert result.iteration_time_ms <= naive.iteration_time_ms * (1 + 1e-9)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cpsat_refinement_never_worse_than_greedy(data: st.DataObject) -> None:
    job = data.draw(small_jobs(max_d=2, max_p=3, max_m=3))
    scenario = data.draw(recoverable_scenarios(job, max_failures=1, slow=False))
    result = plan(job, scenario, time_limit=timedelta(seconds=2))
    validate(job, scenario, result.schedule)
    assert result.iteration_time_ms <= result.greedy_ms * (1 + 1e-9)
