"""`recycle simulate` estimates what the plan cache misses (labelled), `--exact` plans as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.contract import FailureScenario
from tests.jobs import uniform_job
from tests.test_whatif_cli import JOB, run
from whatif.cache import PlanCache
from whatif.estimate import ESTIMATE_METHOD, ESTIMATE_TOLERANCE, estimate_record
from whatif.strategies import Costs, make_strategies
from whatif.strategies.recycle import Recycle, plan_record

SIM = ["--mtbf", "2h", "--repair", "30m", "--duration", "1d", "--seed", "3", "--workers", "1"]


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    """tests/test_whatif_cli.py's tiny job, as a file."""
    path = tmp_path / "tiny.json"
    path.write_text(JOB.model_dump_json())
    return path


def test_a_cache_miss_is_estimated_labelled_and_not_cached(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path / "plans")
    model = make_strategies(JOB, Costs(), cache, ("recycle",), exact=False)["recycle"]
    assert isinstance(model, Recycle)
    scenario = FailureScenario(failed=[(0, 1)])
    rec = model.record(scenario)
    assert rec["estimated"] is True and rec["method"] == ESTIMATE_METHOD
    assert rec["iteration_time_ms"] == rec["memory_bound_ms"]
    assert model.num_planned == 0 and not list((tmp_path / "plans").glob("*.json"))
    # a plan in the cache wins over the estimate
    planned = plan_record(JOB, scenario)
    cache.put(planned["key"], planned)
    fresh = make_strategies(JOB, Costs(), cache, ("recycle",), exact=False)["recycle"]
    assert isinstance(fresh, Recycle) and "estimated" not in fresh.record(scenario)


def test_simulate_estimates_cold_and_says_so(
    job_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.json"
    assert run(["simulate", str(job_file), *SIM, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recycle ~" in text and "failure sets estimated (memory-aware bound" in text
    info = json.loads(out.read_text())["recycle_estimates"]
    assert info["method"] == ESTIMATE_METHOD and info["exact"] is False
    rec = info["strategies"]["recycle"]
    assert rec["estimated"] == rec["failure_sets"] > 1 and rec["estimated_time_share"] == pytest.approx(1.0)
    assert all(s["estimated"] for s in rec["sets"])


def test_exact_gives_the_planned_numbers_and_the_estimate_error(
    job_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exact, est = tmp_path / "x.json", tmp_path / "e.json"
    plans = tmp_path / "plans"
    assert run(["simulate", str(job_file), *SIM, "--exact", "--plans", str(plans), "--json", str(exact)]) == 0
    text = capsys.readouterr().out
    assert "recycle ~" not in text and "samples would differ by" in text
    got = json.loads(exact.read_text())
    # the old path: every failure set planned by the model itself (no estimate anywhere)
    from whatif.cli import _failure_sets
    from whatif.events import simulate
    from whatif.strategies import CheckpointRestart, young_daly_interval_s
    from whatif.structured import failure_free_1f1b_ms
    from whatif.trace import generate_trace

    events = generate_trace(JOB, 2 * 3600.0, 1800.0, 86400.0, 3)
    models = make_strategies(JOB, Costs(), PlanCache(None), ("recycle", "recycle+barrier"))
    fb = make_strategies(JOB, Costs(), PlanCache(None), ("checkpoint-restart",))["checkpoint-restart"]
    assert isinstance(fb, CheckpointRestart)
    interval = young_daly_interval_s(2 * 3600.0 / 4, Costs().checkpoint_s)
    old = simulate(JOB, models, fb, events, 86400.0, Costs(), interval, failure_free_1f1b_ms(JOB))
    for name in ("recycle", "recycle+barrier"):
        assert got["strategies"][name]["samples"] == pytest.approx(old[name].samples, rel=1e-12)
        rec = got["recycle_estimates"]["strategies"][name]
        assert rec["estimated"] == 0  # unrecoverable sets have no time to compare
        assert 1 <= rec["estimate_error_where_planned"]["sets"] <= rec["failure_sets"]
        # reported (this 2-micro-batch job cannot fill its pipeline, so the bound is loose here)
        assert rec["all_estimated_samples"] > 0 and abs(rec["all_estimated_difference"]) < 0.5
    assert len({json.dumps(s.failed) for s in _failure_sets(events)}) >= 2
    # the plans --exact wrote are used on the next (default) run: nothing estimated, same numbers
    assert run(["simulate", str(job_file), *SIM, "--plans", str(plans), "--json", str(est)]) == 0
    again = json.loads(est.read_text())
    assert again["recycle_estimates"]["strategies"]["recycle"]["estimated"] == 0
    assert again["strategies"]["recycle"]["samples"] == got["strategies"]["recycle"]["samples"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    d=st.integers(2, 4),
    p=st.integers(2, 4),
    extra=st.integers(0, 4),
    pick=st.integers(0, 10**6),
)
def test_estimate_within_tolerance_of_the_plan(d: int, p: int, extra: int, pick: int) -> None:
    """The estimate is a lower bound, and the greedy plan sits within ESTIMATE_TOLERANCE of it
    (no failure or one failure on a small uniform job with at least 2P micro-batches per pipeline,
    like the shipped GPT instances; with fewer the pipeline cannot fill and the bound is loose)."""
    job = uniform_job(d, p, 2 * p + extra)
    workers = [(i, s) for i in range(d) for s in range(p)]
    failed = [] if pick % 3 == 0 else [workers[pick % len(workers)]]
    scenario = FailureScenario(failed=failed)
    est = estimate_record(job, scenario)["iteration_time_ms"]
    planned = plan_record(job, scenario, keep_schedule=False)["iteration_time_ms"]
    assert est <= planned * (1 + 1e-9)
    assert planned <= est * (1 + ESTIMATE_TOLERANCE)
