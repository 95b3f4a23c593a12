"""The fork server (runtime_adapter/forkserver.py): CPU workers forked from a process that imported
torch once. Real processes: the server's exit-code reports, a kill from outside, the command line a
forked worker shows (cli_inputs.runs_in finds it), a server that dies, and a launch with the fork
server turned off (the plain process start, the path a GPU job takes) against single-process
training."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest

from runtime_adapter import checkpoint, forkserver
from runtime_adapter.cli_inputs import runs_in
from runtime_adapter.forkserver import ForkedWorker, ForkServer, ForkServerError
from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.stop_signals import WorkerPopen
from tests.jobs import precomputed_inputs, tiny_job
from tests.test_launch_resume import JOB, WORKERS, N, launch
from tests.test_runtime_process import CFG, assert_matches_reference, planner_schedules


def server_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))


def env_with_startup_hook(tmp_path: Path, code: str) -> dict[str, str]:
    """server_env() whose interpreter runs `code` at start-up (a `sitecustomize` in `tmp_path`)."""
    (tmp_path / "sitecustomize.py").write_text(code)
    return dict(server_env(), PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))


@pytest.fixture
def server(tmp_path: Path):
    s = ForkServer(server_env())
    yield s
    s.close()


@pytest.mark.timeout(60)
def test_forked_workers_report_their_codes_and_a_kill_from_outside(
    server: ForkServer, tmp_path: Path
) -> None:
    """A command that ends (0), one with bad input (2, its message in its log), one killed -9 from
    outside (-9, as Popen says it): each code comes from the server's reaping. The running one shows
    the server's command line, `worker --out <dir>`, so the checks that look for a launch's live
    workers by pid find it."""
    assert server.alive
    ok = server.spawn(["store", "--help"], server_env(), tmp_path / "ok.log")
    bad = server.spawn(["store", "--port", "-5"], server_env(), tmp_path / "bad.log")
    running = server.spawn(["store", "--host", "127.0.0.1"], server_env(), tmp_path / "running.log")
    assert isinstance(ok, ForkedWorker) and len({ok.pid, bad.pid, running.pid}) == 3
    assert ok.wait(30) == 0 and "--port" in (tmp_path / "ok.log").read_text()
    assert bad.wait(30) == 2 and "port" in (tmp_path / "bad.log").read_text()
    assert running.poll() is None and runs_in(running.pid, tmp_path)
    os.kill(running.pid, signal.SIGKILL)
    assert running.wait(30) == -signal.SIGKILL
    assert not runs_in(running.pid, tmp_path)
    # the supervisor's own signals go through a pidfd: they reach this process, and after its end nothing
    stopped = server.spawn(["store", "--host", "127.0.0.1"], server_env(), tmp_path / "stopped.log")
    assert stopped._pidfd is not None
    stopped.terminate()
    assert stopped.wait(30) == -signal.SIGTERM
    assert stopped._pidfd is None  # closed once its code is known
    stopped.kill()  # ended: a no-op, whoever has its pid now


@pytest.mark.timeout(60)
def test_a_dead_server_refuses_new_workers_and_its_orphans_are_not_lost(tmp_path: Path) -> None:
    """The server killed -9: a worker it forked runs on (nobody reaps it here, so poll says None while
    it lives, then -9), and a new spawn raises ForkServerError (the supervisor then starts plain
    processes)."""
    s = ForkServer(server_env())
    orphan = s.spawn(["store", "--host", "127.0.0.1"], server_env(), tmp_path / "orphan.log")
    s.proc.kill()
    s.proc.wait()
    deadline = time.monotonic() + 10
    while s.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not s.alive
    with pytest.raises(ForkServerError):
        s.spawn(["store", "--help"], server_env(), tmp_path / "late.log")
    assert orphan.poll() is None
    os.kill(orphan.pid, signal.SIGKILL)
    assert orphan.wait(30) == -signal.SIGKILL
    s.close()


@pytest.mark.timeout(120)
def test_a_launch_without_the_fork_server_starts_plain_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RECYCLE_FORK_WORKERS=0 (and every --device cuda launch): each worker is a process of its own,
    and training ends as single-process training does."""
    monkeypatch.setenv("RECYCLE_FORK_WORKERS", "0")
    job = tiny_job(2, 2)
    launcher = Launcher(LaunchSpec(job, asdict(CFG), 3, tmp_path), planner_schedules(job))  # type: ignore[arg-type]
    launcher.start()
    assert all(isinstance(p, WorkerPopen) for p in launcher.procs.values())
    codes = launcher.wait(timedelta(seconds=90))
    assert all(rc == 0 for rc in codes.values()), codes
    assert_matches_reference(tmp_path, job, 3, list(launcher.procs))


@pytest.mark.timeout(240)
def test_a_fork_server_killed_mid_run_takes_its_workers_and_the_launch_restores(tmp_path: Path) -> None:
    """The fork server of a 2 x 2 launch with checkpoints is killed -9 mid-run: the workers it forked
    end with it (each within its parent watch, 0.5 s), a stage is lost, and the launcher restores from
    the newest complete checkpoint with workers forked from a new server. A worker that ends after the
    restore was decided is one more failure, re-routed to its peer. The launch trains to the end, and
    every worker that finished holds the parameters of single-process training."""
    inputs = precomputed_inputs(tmp_path, JOB)
    out = tmp_path / "run"
    run = subprocess.Popen(launch(inputs, out, "--pace-ms", "150", "--plan-on-demand"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while (checkpoint.latest_complete(out / "checkpoints", 2) or 0) < 2:
        assert run.poll() is None and time.monotonic() < deadline, "no checkpoint before the end"
        time.sleep(0.1)
    pids = [int((out / f"worker_{d}_{s}.pid").read_text()) for d, s in WORKERS]
    servers = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in pids}
    assert len(servers) == 1 and all(runs_in(pid, out) for pid in pids), servers  # the workers' parent
    (server,) = servers
    assert "runtime_adapter.forkserver" in Path(f"/proc/{server}/cmdline").read_text()
    os.kill(server, signal.SIGKILL)
    said, _ = run.communicate(timeout=180)
    # one restore, or two when the second stage's workers end only after the first was decided
    assert run.returncode == 0 and re.search(r"restores from a checkpoint: [12]\n", said), said[-3000:]
    finished = [w for w in WORKERS if (out / f"final_{w[0]}_{w[1]}.pt").exists()]
    assert {s for _, s in finished} == {0, 1}, said[-3000:]
    assert_matches_reference(out, JOB, N, finished)


@pytest.mark.timeout(60)
def test_a_server_that_never_says_ready_is_ended_and_refuses_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server stuck before its ready line (here: a `sitecustomize` that sleeps; in life a hung
    import) is killed after READY_TIMEOUT_S and refuses spawns, so the supervisor starts plain
    processes instead of waiting forever."""
    monkeypatch.setattr(forkserver, "READY_TIMEOUT_S", 2.0)
    env = env_with_startup_hook(tmp_path, "import time\ntime.sleep(600)\n")
    started = time.monotonic()
    s = ForkServer(env)
    assert not s.alive and time.monotonic() - started < 10
    assert s.proc.wait(10) == -signal.SIGKILL
    with pytest.raises(ForkServerError):
        s.spawn(["store", "--help"], server_env(), tmp_path / "late.log")
    s.close()


@pytest.mark.timeout(60)
def test_a_server_that_prints_at_start_up_still_serves(tmp_path: Path) -> None:
    """Output on the server's stdout before its ready line (here a `sitecustomize` that prints a line
    and a partial one; in life an interpreter start-up hook) is skipped: the server is ready and
    forks workers."""
    hook = "import sys\nsys.stdout.write('hello from start-up\\nno newline'); sys.stdout.flush()\n"
    env = env_with_startup_hook(tmp_path, hook)  # a whole line and a partial one
    s = ForkServer(env)
    try:
        assert s.alive
        assert s.spawn(["store", "--help"], server_env(), tmp_path / "ok.log").wait(30) == 0
    finally:
        s.close()
