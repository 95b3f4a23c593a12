"""bench/idle_breakdown.py splits a busiest worker's period exactly; bench/adjacent_random.py draws
what it says (adjacent stages, distinct pipelines); bad input is one line and exit 2."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.adjacent_random import random_case
from bench.idle_breakdown import breakdown
from bench.idle_breakdown import main as idle_main
from planner.contract import FailureScenario
from planner.plan import plan
from tests import jobs


@settings(max_examples=12, deadline=None)
@given(
    D=st.integers(3, 4),
    P=st.integers(2, 4),
    M=st.integers(2, 4),
    first=st.integers(0, 3),
    capacity=st.sampled_from([None, 560.0]),
)
def test_breakdown_adds_up_to_the_period(D: int, P: int, M: int, first: int, capacity: float | None) -> None:
    job = jobs.uniform_job(
        D, P, M, allreduce_ms=0.4, activation_ms=0.05, cross_pipeline_ms=0.1, capacity_mib=capacity
    )
    failed = [(d, s) for d, s in enumerate(range(first % P, min(P, first % P + 2)))]
    scenario = FailureScenario(failed=failed)
    result = plan(job, scenario, time_limit=timedelta(seconds=1), use_cpsat=False)
    rows = breakdown(job, scenario, result.schedule)
    assert [r["stage"] for r in rows] == list(range(P))
    for r in rows:
        parts = r["load"] + r["ar+opt"] + r["first F"] + r["first B"] + r["middle"] + r["at OPT"]
        assert parts == pytest.approx(r["period"], abs=1e-6)
        assert min(r["first F"], r["first B"], r["middle"], r["at OPT"]) >= -1e-9
        assert r["period"] >= r["load"] + r["ar+opt"] - 1e-6  # the load bound's terms


@pytest.mark.parametrize("chain", [1, 2, 3, 4])
def test_random_cases_are_adjacent_chains(chain: int) -> None:
    rng = random.Random(chain)
    for _ in range(50):
        job, scenario = random_case(rng, chain)
        stages = [s for _, s in scenario.failed]
        pipes = [d for d, _ in scenario.failed]
        assert stages == list(range(stages[0], stages[0] + chain))
        assert len(set(pipes)) == chain and max(pipes) < job.num_pipelines
        assert stages[-1] < job.num_stages and job.num_microbatches >= 2 * job.num_pipelines
        scenario.check_against(job)


def test_idle_breakdown_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert idle_main([str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot read job spec")
    with pytest.raises(SystemExit) as exc:
        idle_main([str(tmp_path / "missing.json"), "--failed", "0"])
    assert exc.value.code == 2
