"""`recycle launch` stopped from outside, with real torch workers: SIGTERM stops every worker first
(exit 143, one line), as Ctrl-C does (SIGINT to the launcher's process group, workers included: exit
130, one line); SIGKILL leaves no worker behind (each ends when its launcher is gone:
`--exit-with-parent`). Before, SIGTERM and SIGKILL left every worker training on, orphaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import precomputed_inputs, uniform_job, wait_gone

ROOT = Path(__file__).resolve().parent.parent
JOB = uniform_job(2, 2, 2, name="launch-signals")
pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return precomputed_inputs(tmp_path_factory.mktemp("inputs"), JOB)


def start(inputs: tuple[str, str], out: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """A launch whose 4 workers all stepped at least once; (launcher, worker pids)."""
    cmd = [sys.executable, "-m", "recycle_cli", "launch", "--job", inputs[0], "--schedules", inputs[1],
           "--out", str(out), "--iterations", "1000", "--pace-ms", "50", "--timeout", "120"]  # fmt: skip
    proc = subprocess.Popen(  # its own process group, as a terminal's foreground job
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 90
    workers = [(d, s) for d in range(2) for s in range(2)]
    while time.monotonic() < deadline:
        accts = [out / f"acct_{d}_{s}.jsonl" for d, s in workers]
        if all(a.exists() and '"step"' in a.read_text() for a in accts):
            return proc, [int((out / f"worker_{d}_{s}.pid").read_text()) for d, s in workers]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the workers did not step within 90 s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_a_launcher_stopped_from_outside_leaves_no_worker(
    inputs: tuple[str, str], tmp_path: Path, sig: signal.Signals
) -> None:
    proc, pids = start(inputs, tmp_path / "run")
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the whole foreground group
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert wait_gone(pids, 15.0), pids
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "stopped by a signal: every worker stopped" in err and "Traceback" not in err, err
    if sig == signal.SIGINT:
        assert proc.returncode == 130, err
        assert "interrupted: every worker stopped" in err and "Traceback" not in err, err


def test_a_worker_whose_named_parent_is_gone_refuses_to_start(tmp_path: Path) -> None:
    """`--exit-with-parent=PID` where PID is not the worker's parent (its supervisor died between
    starting it and the worker's first look, and it was adopted; or a wrapper sits in between): one
    line, exit 2, instead of watching its adopter. The same worker naming its real parent is past
    that check (it logs that its schedule file is missing) and keeps waiting for it."""
    job = tmp_path / "job.json"
    job.write_text(JOB.model_dump_json())
    cmd = [sys.executable, "-m", "recycle_cli", "worker", "--job", str(job), "--pipeline", "0",
           "--stage", "0", "--schedule-file", str(tmp_path / "none.json"), "--store", "127.0.0.1:1",
           "--iterations", "2", "--out", str(tmp_path / "out")]  # fmt: skip
    log = tmp_path / "kept.log"
    with log.open("wb") as out:
        kept = subprocess.Popen([*cmd, f"--exit-with-parent={os.getpid()}"], cwd=ROOT, stderr=out)
    try:
        orphan = subprocess.run(
            [*cmd, "--exit-with-parent=1"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert orphan.returncode == 2 and orphan.stderr.count("\n") == 1, orphan.stderr[-2000:]
        assert "--exit-with-parent=1: process 1 is not this worker's parent" in orphan.stderr
        deadline = time.monotonic() + 60
        while "schedule source unreachable" not in log.read_text():  # logged after the parent watch
            assert kept.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(1.0)  # longer than the parent watch's poll
        assert kept.poll() is None
    finally:
        kept.kill()
        kept.wait()
