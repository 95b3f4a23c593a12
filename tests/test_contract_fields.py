"""Fields recycle does not read: accepted (CONTRACT.md welcomes extensions) but named, with the
closest known name, by the CLI (stderr) and the service (`warnings`), so a misspelt field does not
silently plan another scenario."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from planner.contract import FailureScenario, JobSpec
from planner.contract_fields import unread_fields

ROOT = Path(__file__).resolve().parents[1]
INSTANCES = sorted((ROOT.parent / "shared" / "instances").glob("*.json")) + sorted(
    (ROOT / "examples").glob("*.json")
)


def tiny_job(**extra: Any) -> dict[str, Any]:
    stage = {"forward": 1, "backward_input": 1, "backward_weight": 1, "optimizer": 0.5,
             "activation_mib": 10, "weight_grad_mib": 5}  # fmt: skip
    comm = {"activation_ms": 0.1, "cross_pipeline_ms": 0.2, "allreduce_ms": 1}
    return {"name": "t", "num_pipelines": 2, "num_stages": 2, "num_microbatches": 2,
            "stages": [stage, dict(stage)], "comm": comm, **extra}  # fmt: skip


def test_misspelt_fields_are_named_with_the_closest_known_name() -> None:
    sc = FailureScenario.model_validate(
        {"failed_workers": [[1, 0]], "slow": [{"worker": [0, 1], "factor": 2, "fator": 3}]}
    )
    assert sc.failed == []  # valid, and the failure-free scenario: hence the warning
    assert unread_fields(sc, "scenario.") == [
        "scenario.failed_workers: not a field recycle reads, ignored (did you mean 'failed'?)",
        "scenario.slow[0].fator: not a field recycle reads, ignored (did you mean 'factor'?)",
    ]
    doc = tiny_job(memory_capacity=40, notes="from the profiler")
    doc["stages"][1]["forwrd"] = 2
    doc["comm"]["allreduce"] = 3
    lines = unread_fields(JobSpec.model_validate(doc))
    assert sorted(lines) == sorted(
        [
            "memory_capacity: not a field recycle reads, ignored (did you mean 'memory_capacity_mib'?)",
            "notes: not a field recycle reads, ignored",
            "stages[1].forwrd: not a field recycle reads, ignored (did you mean 'forward'?)",
            "comm.allreduce: not a field recycle reads, ignored (did you mean 'allreduce_ms'?)",
        ]
    )


def test_the_extensions_recycle_reads_are_not_named() -> None:
    doc = tiny_job(model={"layers": 4}, partition=[[0, 2], [2, 4]])
    doc["comm"]["migration_mib_per_ms"] = 10
    assert unread_fields(JobSpec.model_validate(doc)) == []
    assert unread_fields(FailureScenario(failed=[(1, 0)])) == []
    assert INSTANCES, "no shipped instances found"
    for path in INSTANCES:
        assert unread_fields(JobSpec.model_validate_json(path.read_text())) == [], path.name


def test_plan_cli_warns_on_stderr_and_keeps_stdout_clean(tmp_path: Path) -> None:
    job, scenario = tmp_path / "job.json", tmp_path / "scenario.json"
    job.write_text(json.dumps(tiny_job()))
    scenario.write_text(json.dumps({"failed_workers": [[1, 0]]}))
    cmd = [
        sys.executable,
        "-m",
        "recycle_cli",
        "plan",
        str(job),
        "--scenario",
        str(scenario),
        "--no-cpsat",
        "--json",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert (
        f"warning: failure scenario {scenario}: failed_workers: not a field recycle reads, ignored "
        "(did you mean 'failed'?)" in r.stderr
    )
    json.loads(r.stdout)  # the answer itself stays machine-readable


@pytest.fixture()
def client(tmp_path: Path):  # type: ignore[no-untyped-def]
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from api.main import create_app
    from api.settings import Settings

    app = create_app(Settings(data_dir=tmp_path, controller_token="ctl", precompute_time_limit_s=1.0))  # type: ignore[arg-type]
    with TestClient(app) as c:
        yield c


CTL = {"Authorization": "Bearer ctl"}


def test_service_returns_the_warnings(client) -> None:  # type: ignore[no-untyped-def]
    body = {"job": tiny_job(), "scenario": {"failed_workers": [[1, 0]]}, "use_cpsat": False}
    r = client.post("/v1/plan", json=body, headers=CTL)
    assert r.status_code == 200, r.text
    assert r.json()["warnings"] == [
        "scenario.failed_workers: not a field recycle reads, ignored (did you mean 'failed'?)"
    ]
    body["scenario"] = {"failed": [[1, 0]]}
    assert client.post("/v1/plan", json=body, headers=CTL).json()["warnings"] == []
    job = {"job": tiny_job(memory_capacity=40), "heartbeat_enabled": False, "max_failures": 0}
    headers = {**CTL, "Idempotency-Key": "warn-key-0001-abcdef"}
    first = client.post("/v1/jobs", json=job, headers=headers)
    assert first.status_code == 201, first.text
    assert first.json()["warnings"] == [
        "job.memory_capacity: not a field recycle reads, ignored (did you mean 'memory_capacity_mib'?)"
    ]
    again = client.post("/v1/jobs", json=job, headers=headers)  # a replayed answer keeps them
    assert again.json() == first.json()
