"""`recycle plan --repartition` and re-partitioned schedules through `recycle validate`, as real
subprocesses: the figures, and bad input as a one-line error with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recycle_cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def job_doc(**extra: Any) -> dict[str, Any]:
    stage = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "optimizer": 0.2,
             "activation_mib": 40.0, "weight_grad_mib": 10.0}  # fmt: skip
    return {
        "name": "tiny",
        "num_pipelines": 3,
        "num_stages": 3,
        "num_microbatches": 3,
        "stages": [stage] * 3,
        "comm": {"activation_ms": 0.01, "cross_pipeline_ms": 0.02, "allreduce_ms": 0.3},
        "model": {"layers": 6, "hidden": 256},
        "memory_capacity_mib": 400.0,
        **extra,
    }


def write(tmp_path: Path, doc: dict[str, Any], name: str = "job.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.timeout(120)
def test_plan_repartition_json_and_validate(tmp_path: Path) -> None:
    job = write(tmp_path, job_doc())
    sched = str(tmp_path / "s.json")
    out = run(
        "plan", job, "--fail", "0,1", "--fail", "1,1", "--repartition", "--no-cpsat", "--json", "-o", sched
    )
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)["repartition"]
    assert rep["repartitioned"] and rep["partition"][1][1] - rep["partition"][1][0] < 2
    assert rep["best_load_bound_ms"] <= rep["load_bound_ms"] < rep["reroute_load_bound_ms"]
    assert rep["iteration_time_ms"] < (rep["reroute_only_ms"] or rep["reroute_load_bound_ms"])
    assert rep["migration"]["mib"] > 0 and rep["migration"]["estimated_ms"] > 0
    assert rep["layers_source"] == "derived" and rep["migration"]["bandwidth_source"] == "derived"
    assert json.loads(Path(sched).read_text())["partition"] == rep["partition"]
    ok = run("validate", job, sched)
    assert ok.returncode == 0 and ok.stdout.startswith("VALID"), ok.stdout + ok.stderr
    # Both bounds on the job the schedule runs (its partition's): the memory-aware bound was the
    # original job's, above the plan, and the negative gap printed as "float noise".
    planned, checked = json.loads(out.stdout), json.loads(run("validate", job, sched, "--json").stdout)
    for key in ("lower_bound_ms", "memory_bound_ms"):
        assert checked[key] == pytest.approx(planned[key]), key
    assert checked["gap_to_memory_bound"] >= -1e-9 and "noise" not in ok.stdout
    text = run("plan", job, "--fail", "0,1", "--fail", "1,1", "--repartition", "--no-cpsat")
    assert "load bound, best over all partitions (ms)" in text.stdout and "migration estimate" in text.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"partition": [[0, 2], [1, 4], [4, 6]]}, "partition: layer 1 is held by stages 0 and 1"),
        ({"partition": [[0, 2], [2, 2], [2, 6]]}, "partition: stage 1 holds no layer"),
        ({"partition": [[0, 2], [3, 4], [4, 6]]}, "partition: layer 2 is held by no stage"),
        ({"model": {"hidden": 256}}, "layers: re-partition needs per-layer figures"),
        (
            {"layers": [{"forward": -1.0}] * 6},
            "layers[0].forward: Input should be greater than or equal to 0",
        ),
    ],
)
def test_bad_layer_input_exits_2_naming_it(tmp_path: Path, extra: dict[str, Any], message: str) -> None:
    out = run("plan", write(tmp_path, job_doc(**extra)), "--fail", "0,1", "--repartition", "--no-cpsat")
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


INF_LAYER = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "activation_mib": 1.0,
             "weight_grad_mib": 1.0, "param_mib": float("inf")}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [  # Infinity / NaN (Python's json reads them) used to plan NaN times or crash with a traceback.
        ({"layers": [INF_LAYER] * 6}, "layers[0].param_mib: Input should be a finite number"),
        ({"memory_capacity_mib": [float("inf")] * 3}, "memory_capacity_mib.list[constrained-float].0: Input"),
        ({"stages": [{**job_doc()["stages"][0], "forward": float("nan")}] * 3}, "stages.0.forward: Input"),
    ],
)
def test_non_finite_numbers_exit_2_naming_the_field(
    tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    job = write(tmp_path, job_doc(**extra))
    for flags in ([], ["--repartition"]):
        out = run("plan", job, "--fail", "0,1", "--no-cpsat", *flags)
        assert out.returncode == 2, out.stdout + out.stderr
        assert message in out.stderr and "Traceback" not in out.stderr


def test_partitioned_schedule_with_a_job_lacking_layers_exits_2(tmp_path: Path) -> None:
    doc = job_doc()
    del doc["model"]
    sched = {"job": "tiny", "iteration_time_ms": 1.0, "workers": [], "partition": [[0, 2], [2, 4], [4, 6]]}
    out = run("validate", write(tmp_path, doc), write(tmp_path, sched, "s.json"))
    assert out.returncode == 2 and out.stderr.startswith("error: layers:"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_bad_migration_bandwidth_and_schedule_partition_exit_2(tmp_path: Path) -> None:
    doc = job_doc()
    doc["comm"] = {**doc["comm"], "migration_mib_per_ms": 0}
    out = run("plan", write(tmp_path, doc), "--repartition")
    assert out.returncode == 2 and "comm.migration_mib_per_ms: must be a positive finite number" in out.stderr
    job = write(tmp_path, job_doc())
    sched = {"job": "tiny", "iteration_time_ms": 1.0, "workers": [], "partition": [[0, 2], [2, 1], [1, 6]]}
    bad = run("validate", job, write(tmp_path, sched, "s.json"))
    assert bad.returncode == 2 and "partition: stage 1: range [2, 1) ends before it starts" in bad.stderr
