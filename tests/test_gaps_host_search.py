"""The host-map local search (planner/adaptive/host_search.py): it keeps every peer's count, returns
only replayed improvements, and the planner's plans stay valid with it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from planner.adaptive.host_search import search_hosts
from planner.bounds import load_bound, memory_bound
from planner.contract import FailureScenario, JobSpec
from planner.portfolio import plan_greedy
from planner.problem import Problem
from planner.simulator import validate
from tests import jobs


def counts(problem: Problem) -> Counter[tuple[int, int]]:
    return Counter((h, s) for (s, _, _), h in problem.host.items())


@st.composite
def adjacent_cases(draw: st.DrawFn) -> tuple[JobSpec, FailureScenario]:
    """Tiny jobs with one failed worker on each of 1-3 consecutive stages (distinct pipelines)."""
    D, P, M = draw(st.integers(3, 4)), draw(st.integers(2, 4)), draw(st.integers(2, 4))
    job = jobs.uniform_job(
        D,
        P,
        M,
        op_ms=draw(st.sampled_from([1.0, 1.5])),
        allreduce_ms=draw(st.sampled_from([0.0, 0.5])),
        activation_ms=draw(st.sampled_from([0.0, 0.1])),
        cross_pipeline_ms=draw(st.sampled_from([0.0, 0.2])),
        capacity_mib=draw(st.sampled_from([None, 100.0 * (P + 1) + 60.0])),
    )
    first = draw(st.integers(0, P - 1))
    stages = range(first, min(P, first + draw(st.integers(1, 3))))
    pipes = draw(st.permutations(range(D)))
    return job, FailureScenario(failed=[(pipes[i], s) for i, s in enumerate(stages)])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=adjacent_cases(), seed=st.integers(0, 2**16))
def test_search_keeps_counts_and_only_improves(case: tuple[JobSpec, FailureScenario], seed: int) -> None:
    job, scenario = case
    problem = Problem.build(job, scenario)
    start = plan_greedy(job, scenario, target_ms=0.0, budget_s=0.0, problems=[problem])
    found = search_hosts(
        problem,
        start.schedule.iteration_time_ms,
        0.0,
        budget_s=0.5,
        num_iterations=4,
        seed=seed,
        max_evals=16,
    )
    event(f"improved: {found is not None}")
    if found is None:
        return
    better, _, sched = found
    assert counts(better) == counts(problem)  # both bounds depend on the counts only
    assert all(better.host[k] in better.alive[k[0]] for k in better.host)
    assert sched.iteration_time_ms < start.schedule.iteration_time_ms
    assert sched.iteration_time_ms >= memory_bound(job, scenario) * (1 - 1e-9)
    validate(job, scenario, sched)


@pytest.mark.timeout(150)
def test_adjacent_failures_on_67b_within_half_a_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case that motivated the search: the default greedy policy alone (no look-ahead, which
    closes this gap by itself: tests/test_lookahead.py) is 1.0158x the load bound on the three
    balanced host maps; a seeded search of at most 64 greedy runs gets within 0.5%."""
    monkeypatch.setattr("planner.portfolio.slack_stages", lambda problem: set())
    job = JobSpec.model_validate_json(
        (Path(__file__).parents[1] / "examples" / "gpt3-6.7b-p8d4.json").read_text()
    )
    scenario = FailureScenario(failed=[(0, 1), (1, 2), (2, 3)])
    lb = load_bound(job, scenario)
    start = plan_greedy(job, scenario, target_ms=lb, budget_s=0.0)
    assert start.schedule.iteration_time_ms > lb * 1.01
    found = search_hosts(
        start.problem, start.schedule.iteration_time_ms, lb * 1.0005, 1e9, 6, seed=0, max_evals=64
    )
    assert found is not None
    validate(job, scenario, found[2])
    assert found[2].iteration_time_ms <= lb * 1.005
