"""`recycle precompute`'s local processes, killed from outside: SIGTERM (Slurm, Kubernetes, timeout)
stops it like Ctrl+C (one line, exit 130, the plans written stay) and its planning processes end
with it; a planning process killed (the OOM killer) is one line and exit 1, not a BrokenProcessPool
traceback. Before, SIGTERM left both planning processes sleeping under PID 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import wait_gone

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "examples" / "gpt3-13b-p8d8-mem1x.json")  # 2 s plans: a run long enough to kill
pytestmark = pytest.mark.timeout(120)


def start(out: Path) -> tuple[subprocess.Popen[str], list[int]]:
    cmd = [sys.executable, "-m", "recycle_cli", "precompute", JOB, "--max-failures", "2", "-o", str(out),
           "--time-limit", "2", "--workers", "2", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children_file = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # both planning processes started, a first plan written
        children = [int(c) for c in children_file.read_text().split()]
        if len(children) >= 2 and any(out.glob("*.json")):
            return proc, children
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("precompute did not start planning within 60 s")


def finish(proc: subprocess.Popen[str], children: list[int]) -> str:
    """The run's stderr once it ended; on a timeout the run and its processes are killed."""
    try:
        return proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            wait_gone(children, 0.0)


def test_sigterm_stops_it_like_ctrl_c_and_its_processes_end_with_it(tmp_path: Path) -> None:
    proc, children = start(tmp_path / "plans")
    proc.send_signal(signal.SIGTERM)
    err = finish(proc, children)
    assert proc.returncode == 130 and "interrupted: the plans written so far stay" in err, err
    assert "Traceback" not in err, err
    assert wait_gone(children, 5.0), children


def test_a_killed_planning_process_is_one_line_and_exit_1(tmp_path: Path) -> None:
    proc, children = start(tmp_path / "plans")
    os.kill(children[0], signal.SIGKILL)
    err = finish(proc, children)
    assert proc.returncode == 1 and "a planning process died" in err and "Traceback" not in err, err
    assert wait_gone(children[1:], 5.0), children
