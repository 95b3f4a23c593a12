"""`recycle launch --resume`: a launcher killed with SIGKILL (its workers end with it) loses nothing
its checkpoints hold. The same command with `--resume` publishes a restore version numbered after the
earlier launch's, starts every worker from the newest complete checkpoint and trains to the end:
every micro-batch of every iteration counted once and the final parameters equal single-process
training. Plus its checks before anything starts (one line, exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime_adapter import checkpoint
from runtime_adapter.accounting import read_records
from tests.jobs import precomputed_inputs, uniform_job, wait_gone
from tests.test_runtime_process import (
    assert_exactly_once,
    assert_losses_match,
    assert_matches_reference,
)

ROOT = Path(__file__).resolve().parent.parent
JOB = uniform_job(2, 2, 2, name="launch-resume")
WORKERS = [(d, s) for d in range(2) for s in range(2)]
N = 12  # iterations
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return precomputed_inputs(tmp_path_factory.mktemp("inputs"), JOB)


def launch(inputs: tuple[str, str], out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "recycle_cli", "launch", "--job", inputs[0], "--schedules", inputs[1],
            "--out", str(out), "--iterations", str(N), "--checkpoint-every", "2", "--timeout", "150",
            *extra]  # fmt: skip


def test_a_killed_launch_resumes_from_its_checkpoint_and_ends_as_if_never_killed(
    inputs: tuple[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    first = subprocess.Popen(launch(inputs, out, "--pace-ms", "150"), cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while (checkpoint.latest_complete(out / "checkpoints", 2) or 0) < 4:
        assert first.poll() is None and time.monotonic() < deadline, "no checkpoint at 4 before the end"
        time.sleep(0.1)
    pids = [int((out / f"worker_{d}_{s}.pid").read_text()) for d, s in WORKERS]
    first.kill()  # SIGKILL: no clean-up; the workers end with it (--exit-with-parent)
    first.communicate(timeout=30)
    assert wait_gone(pids, 15.0), pids
    before = json.loads((out / "schedule.json").read_text())["version"]
    stepped = max(r["it"] for r in read_records(out, (0, 0)) if r["event"] == "step") + 1
    assert stepped < N, "the first launch ended before it was killed"

    run = subprocess.run(
        launch(inputs, out, "--resume"), cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    said = [ln for ln in run.stdout.splitlines() if f"resumed the launch in {out}: restored from" in ln]
    everyone = "restarting [0, 0], [0, 1], [1, 0], [1, 1]: training again after"
    assert len(said) == 1 and everyone in said[0], run.stdout  # the summary's restore line
    for w in WORKERS:
        resumed = [r for r in read_records(out, w) if r["event"] == "resume"]
        assert len(resumed) == 1 and resumed[0]["stepped"] >= 4, (w, resumed)
        k, version = resumed[0]["stepped"], resumed[0].get("version", before + 1)
        assert version == before + 1, (w, resumed)  # after every version of the first launch
        redone = [r["it"] for r in read_records(out, w) if r["event"] == "step" and r["version"] > before]
        assert redone == list(range(k, N)), (w, k, redone)  # from the checkpoint on, once each
    rows = (out / "loss.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(N)), rows  # each iteration once
    assert_exactly_once(out, JOB, N)
    assert_losses_match(out, JOB, N)
    assert_matches_reference(out, JOB, N, WORKERS)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    from recycle_cli import main

    try:
        code = main(argv[3:])  # without "python -m recycle_cli"
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err.strip().splitlines()


def test_what_cannot_resume_is_one_line_before_anything_starts(
    inputs: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code, err = _cli(launch(inputs, out, "--resume"), capsys)
    assert code == 2 and len(err) == 1 and "holds no launch (no readable job.json)" in err[0], err
    out.mkdir()
    (out / "job.json").write_text(uniform_job(2, 2, 4, name="other").model_dump_json())
    code, err = _cli(launch(inputs, out, "--resume"), capsys)
    assert code == 2 and len(err) == 1 and "holds a launch of another job ('other'" in err[0], err
    (out / "job.json").write_text(JOB.model_dump_json())
    code, err = _cli(launch(inputs, out, "--resume"), capsys)
    assert code == 2 and len(err) == 1 and "has no schedule.json" in err[0], err
    (out / "schedule.json").write_text("{}")
    with (out / "worker_1_0.log").open("ab") as log:  # a worker: `worker` in its argv, its log in out
        sleeper = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)", "worker"], stdout=log
        )
    try:
        (out / "worker_1_0.pid").write_text(f"{sleeper.pid}\n")
        code, err = _cli(launch(inputs, out, "--resume"), capsys)
        assert code == 2 and len(err) == 1, err
        assert f"worker [1, 0] of the launch in {out} still runs (pid {sleeper.pid})" in err[0], err
    finally:
        sleeper.kill()
        sleeper.wait()
    code, err = _cli(launch(inputs, out, "--resume"), capsys)
    assert code == 2 and len(err) == 1 and "is not a launch's schedule file" in err[0], err
    (out / "schedule.json").write_text('{"version": 100000000000000000000000}')  # was resumed at 1e23 + 1
    code, err = _cli(launch(inputs, out, "--resume"), capsys)
    assert code == 2 and len(err) == 1 and "version 100000000000000000000000 is not a version" in err[0], err
    argv = [a for a in launch(inputs, out, "--resume") if a not in ("--checkpoint-every", "2")]
    code, err = _cli(argv, capsys)
    assert code == 2 and len(err) == 1 and "--resume needs --checkpoint-every N" in err[0], err
