"""The greedy portfolio's budget: the default policy on every host map and the look-ahead policy on
the first run whatever the budget, unless the first trial alone takes longer than the budget and
LONG_TRIAL_S (a job where one trial takes about a minute: D=P=M=64); then only the first runs."""

from __future__ import annotations

from pathlib import Path

import pytest

import planner.portfolio as portfolio
from planner.bounds import load_bound
from planner.contract import FailureScenario, JobSpec
from planner.problem import Problem

EXAMPLES = Path(__file__).parents[1] / "examples"

pytestmark = pytest.mark.timeout(120)


def trials_run(monkeypatch: pytest.MonkeyPatch, long_trial_s: float) -> int:
    monkeypatch.setattr(portfolio, "LONG_TRIAL_S", long_trial_s)
    job = JobSpec.model_validate_json((EXAMPLES / "gpt3-6.7b-p8d4.json").read_text())
    scenario = FailureScenario(failed=[(0, 1), (1, 2), (2, 3)])
    lines: list[str] = []
    portfolio.plan_greedy(
        job,
        scenario,
        target_ms=load_bound(job, scenario) * 0.5,  # out of reach: only the budget stops the portfolio
        budget_s=0.0,
        progress=lines.append,
        problems=[Problem.build(job, scenario)],
    )
    return sum("greedy trial" in line for line in lines)


def test_guaranteed_trials_run_whatever_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    assert trials_run(monkeypatch, portfolio.LONG_TRIAL_S) >= 2  # default policy, then look-ahead


def test_a_first_trial_longer_than_long_trial_s_is_the_only_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert trials_run(monkeypatch, 0.0) == 1
