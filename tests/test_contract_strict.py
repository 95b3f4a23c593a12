"""Worker indices and the grid's counts are integers, not `true`, `"1"` or `1.0`: a boolean worker
[true, false] once read as [1, 0], lost a stage and restored the job; figures so large that an
iteration overflows are refused (outside audit, session 9)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from planner.contract import FailureScenario, JobSpec, Schedule

ROOT = Path(__file__).resolve().parent.parent
JOB = json.loads((ROOT / "examples" / "gpt3-1.3b-p4d4.json").read_text())


@pytest.mark.parametrize("worker", [[True, False], ["1", 0], [1.0, 0], [0, -1]])
def test_worker_indices_are_integers(worker: list[Any]) -> None:
    with pytest.raises(ValidationError):
        FailureScenario.model_validate({"failed": [worker]})
    with pytest.raises(ValidationError):
        FailureScenario.model_validate_json(json.dumps({"slow": [{"worker": worker, "factor": 2}]}))
    assert FailureScenario.model_validate({"failed": [[1, 0]]}).failed == [(1, 0)]


@pytest.mark.parametrize("mb", [[True, 0], ["1", 0], [1.0, 0], [0, -1]])
def test_schedule_micro_batches_are_integers(mb: list[Any]) -> None:
    """A schedule's `mb` read `[true, 0]` as micro-batch [1, 0] (outside review, session 14)."""
    action = {"op": "F", "mb": [0, 0], "start_ms": 0.0, "end_ms": 1.0}
    doc = {
        "job": "j",
        "failed": [],
        "iteration_time_ms": 1.0,
        "workers": [{"worker": [0, 0], "actions": [action]}],
    }
    assert Schedule.model_validate(doc).workers[0].actions[0].mb == (0, 0)
    doc["workers"][0]["actions"][0] = {**action, "mb": mb}  # type: ignore[index]
    with pytest.raises(ValidationError, match="mb"):
        Schedule.model_validate_json(json.dumps(doc))


@pytest.mark.parametrize("field", ["num_pipelines", "num_stages", "num_microbatches"])
@pytest.mark.parametrize("value", [True, "4", 4.0])
def test_grid_counts_are_integers(field: str, value: Any) -> None:
    with pytest.raises(ValidationError, match=field):
        JobSpec.model_validate({**JOB, field: value})
    JobSpec.model_validate_json(json.dumps(JOB))  # the shipped example still reads


@pytest.mark.parametrize("value", [True, "1.5"])
@pytest.mark.parametrize("where", ["stage", "comm", "capacity", "slow"])
def test_figures_are_numbers(where: str, value: Any) -> None:
    """A duration `true` was read as 1 ms, `"1.5"` as 1.5: a spec written by a broken generator
    planned (outside review, session 14). Integers stay numbers."""
    doc = json.loads(json.dumps(JOB))
    if where == "slow":
        with pytest.raises(ValidationError, match="factor"):
            FailureScenario.model_validate({"slow": [{"worker": [0, 0], "factor": value}]})
        assert FailureScenario.model_validate({"slow": [{"worker": [0, 0], "factor": 2}]}).slow[0].factor == 2
        return
    target, key = {"stage": (doc["stages"][0], "forward"), "comm": (doc["comm"], "activation_ms"),
                   "capacity": (doc, "memory_capacity_mib")}[where]  # fmt: skip
    target[key] = value
    with pytest.raises(ValidationError, match=key):
        JobSpec.model_validate_json(json.dumps(doc))
    target[key] = 3
    JobSpec.model_validate_json(json.dumps(doc))


def test_service_refuses_a_boolean_worker(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from api.main import create_app
    from api.settings import Settings

    ctl = {"Authorization": "Bearer ctl"}
    app = create_app(Settings(data_dir=tmp_path, controller_token="ctl"))  # type: ignore[arg-type]
    with TestClient(app) as c:
        body = {"job": JOB, "max_failures": 0, "heartbeat_enabled": False}
        job_id = c.post("/v1/jobs", json=body, headers=ctl).json()["id"]
        ev = {"event_id": "e1", "kind": "fail", "workers": [[True, False]]}
        r = c.post(f"/v1/jobs/{job_id}/events", json=ev, headers=ctl)
        assert r.status_code == 422, r.text
        assert c.get(f"/v1/jobs/{job_id}", headers=ctl).json()["failed"] == []


def test_figures_whose_iteration_overflows_are_refused() -> None:
    doc = json.loads(json.dumps(JOB))
    for st in doc["stages"]:
        st["forward"] = 1e308  # finite, but D*M of them are not: NaN figures and a 500 before
    with pytest.raises(ValidationError, match="the figures are too large"):
        JobSpec.model_validate(doc)
    for st in doc["stages"]:
        st["forward"] = 1e6  # large, but an iteration stays a number
    JobSpec.model_validate(doc)
