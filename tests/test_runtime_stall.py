"""A training thread that hangs in its own computation (runtime_adapter/stall.py).

Unit: the watchdog ends a compute section that outlasts the timeout, never a short one, and does not
count time the whole process was stopped. Process: a real launch whose data function deadlocks in
one worker at iteration 2 (its polling thread and heartbeats go on): that worker ends itself with
EXIT_STALLED after RECYCLE_STALL_TIMEOUT_S, its launcher reports it failed, and the survivors finish
with single-process training's parameters. Before, nobody failed it: its peers' collectives timed
out, they waited for a version that never came, and the launch ended with every worker failed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest

from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.stall import EXIT_STALLED, StallWatch
from tests.jobs import tiny_job
from tests.test_runtime_process import CFG, assert_exactly_once, assert_matches_reference, planner_schedules

pytestmark = pytest.mark.timeout(180)


def _watch(timeout_s: float) -> tuple[StallWatch, list[tuple[str, float]], threading.Event]:
    stalls: list[tuple[str, float]] = []
    fired = threading.Event()

    def on_stall(what: str, ran: float, timeout: float) -> None:
        stalls.append((what, ran))
        fired.set()

    return StallWatch(timeout_s, on_stall), stalls, fired


def test_a_section_longer_than_the_timeout_is_a_stall_and_short_ones_are_not() -> None:
    watch, stalls, fired = _watch(0.4)
    for _ in range(10):
        with watch.busy("F mb=[0, 0]"):
            time.sleep(0.1)
        time.sleep(0.3)  # outside a section: waits on peers do not count
    assert stalls == []
    with watch.busy("B mb=[1, 0]"):
        assert fired.wait(5.0)
    assert stalls[0][0] == "B mb=[1, 0]" and stalls[0][1] > 0.4


def test_time_the_process_was_stopped_is_not_counted(tmp_path: Path) -> None:
    """A child process in a 1.5 s section is stopped for 3 s: no stall (it would be with the pause)."""
    script = (
        "import sys, time\n"
        "from runtime_adapter.stall import StallWatch\n"
        "w = StallWatch(1.5, lambda what, ran, t: (print('stall', round(ran, 1), flush=True), sys.exit(0)))\n"
        "with w.busy('F'):\n"
        "    print('busy', flush=True)\n"
        "    time.sleep(1.2)\n"
        "print('done', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "busy"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(3.0)
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == "done", out


def test_a_worker_whose_data_function_hangs_ends_itself_and_the_others_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, n = tiny_job(2, 2), 6
    flag = tmp_path / "hang"
    flag.write_text("")
    monkeypatch.setenv("RECYCLE_STALL_TIMEOUT_S", "3")
    out = tmp_path / "run"
    model = {**asdict(CFG), "hang_flag": str(flag)}
    spec = LaunchSpec(job, model, n, out, entry="tests.library_entries:hangs_once")
    launcher = Launcher(spec, planner_schedules(job))  # type: ignore[arg-type]
    launcher.start()
    codes = launcher.wait(timedelta(seconds=150))
    hung = [w for w, rc in codes.items() if rc == EXIT_STALLED]
    assert not flag.exists() and len(hung) == 1, codes  # [1, 0] or [1, 1]: whichever read [1, 0] first
    survivors = [w for w in codes if w not in hung]
    assert all(codes[w] == 0 for w in survivors), codes
    assert launcher.failed == set(hung)
    log = (out / f"worker_{hung[0][0]}_{hung[0][1]}.log").read_text()
    assert "the training thread has been in F mb=[1, 0]" in log, log[-2000:]
    assert_exactly_once(out, job, n)
    assert_matches_reference(out, job, n, survivors)
