"""The `recycle` command: happy paths and bad input, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "gpt3-1.3b-p4d4.json"


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recycle_cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_plan_writes_schedule_gantt_trace_and_validates(tmp_path: Path) -> None:
    out, png, trace = tmp_path / "s.json", tmp_path / "s.png", tmp_path / "s.trace.json"
    r = run("plan", str(JOB), "--fail", "1,2", "-o", str(out), "--gantt", str(png), "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    assert "iteration time (ms)" in r.stdout and "throughput retained" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "recycle-schedule/1" and doc["failed"] == [[1, 2]]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(trace.read_text())["traceEvents"]
    v = run("validate", str(JOB), str(out), "--json")
    assert v.returncode == 0, v.stderr
    assert json.loads(v.stdout)["valid"] is True


def test_plan_json_figures() -> None:
    r = run("plan", str(JOB), "--fail", "0,0", "--json", "--no-cpsat")
    assert r.returncode == 0, r.stderr
    fig = json.loads(r.stdout)
    assert fig["iteration_time_ms"] >= fig["lower_bound_ms"] * (1 - 1e-9)
    assert fig["failed"] == [[0, 0]]


def test_validate_reports_broken_rule(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    assert run("plan", str(JOB), "--no-cpsat", "-o", str(out)).returncode == 0
    doc = json.loads(out.read_text())
    # Drop one W: the schedule no longer covers every micro-batch.
    actions = doc["workers"][0]["actions"]
    idx = next(i for i, a in enumerate(actions) if a["op"] == "W")
    del actions[idx]
    out.write_text(json.dumps(doc))
    r = run("validate", str(JOB), str(out))
    assert r.returncode == 4
    assert "INVALID" in r.stdout and "coverage" in r.stdout


@pytest.mark.parametrize(
    ("args", "needle", "code"),
    [
        (["plan", "missing.json"], "cannot read job spec missing.json", 2),
        (["plan", str(JOB), "--fail", "1"], "expected a worker as PIPELINE,STAGE", 2),
        (["plan", str(JOB), "--fail", "9,0"], "outside the job's grid", 2),
        (["plan", str(JOB), "--fail", "1,1", "--fail", "1,1"], "listed twice", 2),
        (["plan", str(JOB), "--slow", "0,1:fast"], "is not a number", 2),
        (
            ["plan", str(JOB), "--fail", "0,3", "--fail", "1,3", "--fail", "2,3", "--fail", "3,3"],
            "stage 3",
            3,
        ),
        (["validate", str(JOB), "nope.json"], "cannot read schedule nope.json", 2),
    ],
)
def test_bad_input_is_named(args: list[str], needle: str, code: int) -> None:
    r = run(*args)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert needle in r.stderr


def test_malformed_json_and_invalid_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = run("plan", str(bad))
    assert r.returncode == 2 and "is not valid JSON" in r.stderr and "line 1" in r.stderr
    spec = json.loads(JOB.read_text())
    spec["stages"] = spec["stages"][:3]
    spec["stages"][0]["forward"] = -1
    bad.write_text(json.dumps(spec))
    r = run("plan", str(bad))
    assert r.returncode == 2
    assert "stages.0.forward" in r.stderr
