"""The what-if strategy recycle+repartition: no slower than recycle, migration charged per change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.contract import FailureScenario, JobSpec
from whatif.cache import PlanCache
from whatif.strategies import Costs, make_strategies

ROOT = Path(__file__).resolve().parents[1]


def tiny_layered_job() -> JobSpec:
    stage = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "optimizer": 0.2,
             "activation_mib": 40.0, "weight_grad_mib": 10.0}  # fmt: skip
    return JobSpec.model_validate(
        {"name": "tiny", "num_pipelines": 3, "num_stages": 3, "num_microbatches": 3, "stages": [stage] * 3,
         "comm": {"activation_ms": 0.01, "cross_pipeline_ms": 0.02, "allreduce_ms": 0.3,
                  "migration_mib_per_ms": 0.5},
         "model": {"layers": 6, "hidden": 256}, "memory_capacity_mib": 400.0}
    )  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exact", [True, False])
def test_no_slower_than_recycle_and_charges_migration(tmp_path: Path, exact: bool) -> None:
    job = tiny_layered_job()
    names = ("recycle", "recycle+repartition")
    models = make_strategies(job, Costs(reroute_s=10.0), PlanCache(tmp_path), names, exact=exact)
    rec, rep = models["recycle"], models["recycle+repartition"]
    none, two = FailureScenario(), FailureScenario(failed=[(0, 1), (1, 1)])
    assert rep.outcome(none).iteration_time_ms == pytest.approx(rec.outcome(none).iteration_time_ms)
    ms_rec, ms_rep = rec.outcome(two).iteration_time_ms, rep.outcome(two).iteration_time_ms
    assert ms_rep is not None and ms_rec is not None and ms_rep < ms_rec
    moved = rep.switch_s - 10.0  # the change to the two-failure split: its layers' state over 0.5 MiB/ms
    assert moved > 0
    rep.outcome(none)
    back = rep.switch_s - 10.0  # and back on re-join: every sender alive, each sends its own copy,
    assert 0 < back < moved  # while the move out had one live peer of stage 1 send all three
    rep.outcome(none)
    assert rep.switch_s == pytest.approx(10.0)  # no change of split: re-route cost only
    assert rep.outcome(FailureScenario(failed=[(0, 1), (1, 1), (2, 1)])).fatal
    kind = "repartition" if exact else "repartition-estimate"
    assert any((tmp_path / kind).glob("*.json"))  # cached for the next run


@pytest.mark.timeout(120)
def test_whatif_cli_line_up(tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(tiny_layered_job().model_dump_json())
    out = subprocess.run(
        [sys.executable, "-m", "recycle_cli", "whatif", str(job), "--max-failures", "2", "--json",
         str(tmp_path / "w.json"), "--strategies", "recycle,recycle+repartition,oobleck", "--workers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "recycle+repartition" in out.stdout
    cells = {
        (c["strategy"], c["num_failures"]): c for c in json.loads((tmp_path / "w.json").read_text())["cells"]
    }
    for k in (1, 2):
        assert (
            cells[("recycle+repartition", k)]["worst_retained"]
            >= cells[("recycle", k)]["worst_retained"] - 1e-9
        )


def test_without_a_failure_the_job_keeps_its_own_partition(tmp_path: Path) -> None:
    """Before: the failure-free set re-partitioned too (gpt3-1.3b-p4d4: 534.4 ms on a rebalanced split
    against 590.9 on the job's own), so the strategy beat the failure-free run it is measured by."""
    job = JobSpec.model_validate_json((ROOT / "examples" / "gpt3-1.3b-p4d4.json").read_text())
    none = FailureScenario()
    for exact in (False, True):
        names = ("recycle", "recycle+repartition")
        models = make_strategies(job, Costs(), PlanCache(tmp_path), names, exact=exact)
        rep, own = models["recycle+repartition"], models["recycle"].outcome(none).iteration_time_ms
        assert rep.outcome(none).iteration_time_ms == pytest.approx(own)
        assert rep.switch_s == pytest.approx(Costs().reroute_s)  # no layer moved
        assert rep.used[next(iter(rep.used))].get("estimated", False) is not exact


@pytest.mark.timeout(120)
def test_simulate_marks_repartition_estimates(tmp_path: Path) -> None:
    """Before: recycle+repartition's estimated iteration times were not labelled `~` in the table."""
    job = tmp_path / "job.json"
    job.write_text(tiny_layered_job().model_dump_json())
    out = subprocess.run(
        [sys.executable, "-m", "recycle_cli", "simulate", str(job), "--strategies", "recycle+repartition",
         "--mtbf", "2h", "--duration", "2d", "--seed", "3", "--json", str(tmp_path / "s.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "recycle+repartition ~" in out.stdout, out.stdout
    report = json.loads((tmp_path / "s.json").read_text())["recycle_estimates"]["strategies"]
    entry = report["recycle+repartition"]
    assert entry["estimated"] == entry["failure_sets"] > 1, entry
