"""Heartbeat files (runtime_adapter/heartbeats.py): with a schedule file and no service, the launcher
ends a worker that stopped polling (SIGSTOP) and re-routes around it; its peers are not blamed."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest

from runtime_adapter.heartbeats import Heartbeat, Watch, heartbeat_path, silent
from runtime_adapter.launch import SCHEDULE_FILE, Launcher, LaunchSpec
from runtime_adapter.publishers import FilePublisher
from tests.jobs import tiny_job
from tests.test_runtime_process import CFG, assert_exactly_once, assert_matches_reference, planner_schedules
from tests.test_runtime_service import steps, supervise_until


def test_silent_tracks_a_process_from_its_first_beat_until_done(tmp_path: Path) -> None:
    me, other = (0, 1), (1, 1)
    beat = Heartbeat(tmp_path / "beats", me)
    running = {me: os.getpid(), other: os.getpid() + 1}
    assert silent(tmp_path / "beats", running, 1.0) == []  # no file yet: starting, not tracked
    beat.beat()
    assert silent(tmp_path / "beats", running, 1.0) == []
    old = time.time() - 5
    os.utime(beat.path, (old, old))
    assert silent(tmp_path / "beats", running, 1.0) == [me]
    assert silent(tmp_path / "beats", running, 10.0) == []
    beat.beat()  # within HEARTBEAT_EVERY_S of the last: not touched again
    assert silent(tmp_path / "beats", running, 1.0) == [me]
    restarted = {me: os.getpid() + 7}  # a new process of the same worker: its predecessor's file is not its
    assert silent(tmp_path / "beats", restarted, 1.0) == []
    assert heartbeat_path(tmp_path / "beats", me, os.getpid()) == beat.path
    beat.end()
    assert silent(tmp_path / "beats", running, 1.0) == []


def test_a_launcher_that_stalled_judges_nobody_on_its_first_check_back(tmp_path: Path) -> None:
    """A suspended machine (or a stopped launcher) stalls the launcher and its workers alike: on its
    first check back every file is as old as the stall, and the workers beat again within 0.5 s."""
    me = (1, 0)
    beat = Heartbeat(tmp_path, me)
    beat.beat()
    old = time.time() - 60
    os.utime(beat.path, (old, old))
    watch = Watch(tmp_path, 10.0)
    assert watch.silent({me: os.getpid()}) == [me]  # the first check: no gap known
    watch._last = time.time() - 30  # the launcher did not run for 30 s
    assert watch.silent({me: os.getpid()}) == []
    assert watch.silent({me: os.getpid()}) == [me]  # still silent at the next check: judged


@pytest.mark.timeout(200)
def test_a_stopped_worker_is_ended_and_its_peers_train_on(tmp_path: Path) -> None:
    """Before: with --schedules nothing watched a stopped worker; its peers timed out waiting on it
    and were the ones reported failed."""
    job, n, victim, timeout_s = tiny_job(2, 2), 12, (1, 1), 1.5
    spec = LaunchSpec(job, asdict(CFG), n, tmp_path, pace_ms=50)
    pub = FilePublisher(tmp_path / SCHEDULE_FILE, job, planner_schedules(job), heartbeat_timeout_s=timeout_s)  # type: ignore[arg-type]
    launcher = Launcher(spec, publisher=pub)
    launcher.start()
    everyone = spec.workers()
    survivors = [w for w in everyone if w != victim]
    supervise_until(launcher, lambda: steps(tmp_path, everyone) >= 3, "3 steps")
    os.kill(launcher.procs[victim].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    supervise_until(launcher, lambda: victim in pub.failed, "the stopped worker reported", 60)
    assert time.monotonic() - stopped < timeout_s + 5, time.monotonic() - stopped
    codes = launcher.wait(timedelta(seconds=150))
    assert codes[victim] == -signal.SIGKILL and all(codes[w] == 0 for w in survivors), codes
    assert pub.failed == {victim}  # nobody else was taken for failed
    assert_exactly_once(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, survivors)
