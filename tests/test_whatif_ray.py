"""`recycle precompute --ray` on a real two-node Ray cluster started here (bench/precompute_ray_cluster.py).

One cluster for the module: a head and a second node, one CPU each, in process groups of their own, killed
(workers included) at the end. The plans made on Ray are the local path's plans; a node SIGKILLed
while it runs a task loses nothing (the scenario is submitted again); an unreachable address is one
line and exit 2 with the directory left resumable; a task that raises a planner error is reported once
(not submitted again) while the other scenarios are written; Ctrl+C leaves a directory a second run
completes; the cluster's clean-up leaves a process it did not start alone.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.precompute_ray_cluster import LocalRayCluster, process_titles
from planner.contract import FailureScenario
from tests.jobs import uniform_job
from whatif.cache import PlanCache
from whatif.precompute import precompute
from whatif.precompute_ray import ScenariosFailed, plan_on_ray

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

JOB = uniform_job(4, 4, 8)  # 69 normalized scenarios up to 3 failures, ~0.15 s each
FIGURES = ("unrecoverable", "iteration_time_ms", "lower_bound_ms", "memory_bound_ms", "baseline_1f1b_ms")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    # a process of this session the clean-up must not touch (its own group: like the nodes')
    decoy = subprocess.Popen(["sleep", "600"], process_group=0)
    try:
        with LocalRayCluster(nodes=2, cpus=1) as c:
            yield c
        assert decoy.poll() is None, "the cluster's clean-up killed a process it did not start"
    finally:
        decoy.kill()
        decoy.wait()


def _recycle(*args: str, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "recycle_cli", "precompute", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,  # type: ignore[call-overload]
    )


def _figures(root: Path) -> dict[str, tuple[object, ...]]:
    records = {p.stem: PlanCache(root).get(p.stem) for p in root.glob("*.json") if "index" not in p.name}
    return {k: tuple(r.get(f) for f in FIGURES) for k, r in records.items() if r is not None}


def _start(tmp_path: Path, address: str, name: str) -> tuple[Path, Path, subprocess.Popen[str]]:
    """The job file, the output directory and a running `recycle precompute` of JOB up to 3 failures."""
    job = tmp_path / "job.json"
    job.write_text(JOB.model_dump_json())
    out = tmp_path / name
    return (
        job,
        out,
        _recycle(str(job), "--max-failures", "3", "-o", str(out), "--ray", address, "--no-progress"),
    )


@pytest.mark.timeout(150)
def test_a_node_killed_mid_run_loses_nothing(cluster: LocalRayCluster, tmp_path: Path) -> None:
    job, out, run = _start(tmp_path, cluster.address, "ray-plans")
    # SIGKILL the second node while it runs a task (Ray titles a busy worker after its task)
    deadline = time.monotonic() + 60
    while not any("ray::_plan_task" in t for t in process_titles(cluster.groups[1])):
        assert run.poll() is None, f"precompute ended before the second node ran a task: {run.communicate()}"
        assert time.monotonic() < deadline, "the second node never ran a task"
        time.sleep(0.02)
    cluster.kill_node(1)
    done_at_kill = len(list(out.glob("*.json")))
    stdout, stderr = run.communicate(timeout=90)
    assert run.returncode == 0, stderr
    assert done_at_kill < 69
    assert "submitting it again" in stderr, stderr  # the task on the killed node was lost and redone
    assert "69 normalized scenarios" in stdout and "69 planned now" in stdout, stdout

    local = tmp_path / "local-plans"
    precompute(JOB, 3, PlanCache(local), num_workers=2, progress=False)
    on_ray = _figures(out)
    assert len(on_ray) == 69
    assert on_ray == _figures(local)
    assert sorted(p.name for p in out.glob("index-*")) == sorted(p.name for p in local.glob("index-*"))

    again = _recycle(str(job), "--max-failures", "3", "-o", str(out), "--ray", cluster.address)
    stdout, stderr = again.communicate(timeout=60)
    assert again.returncode == 0 and "69 already cached, 0 planned now" in stdout, stderr


@pytest.mark.timeout(150)  # a Ray Client server that misses the head's 30 s start deadline: tried twice
def test_an_unreachable_address_is_one_line_exit_2_and_the_directory_stays_resumable(
    cluster: LocalRayCluster, tmp_path: Path
) -> None:
    job = tmp_path / "job.json"
    job.write_text(JOB.model_dump_json())
    out = tmp_path / "plans"
    precompute(JOB, 0, PlanCache(out), num_workers=1, progress=False)  # an earlier run: k = 0 done
    before = sorted(p.name for p in out.iterdir())
    dead = "127.0.0.1:1"  # nothing listens on port 1
    for flags, env in (
        (["--ray", dead], {}),
        ([], {"RECYCLE_RAY_ADDRESS": dead}),
        (["--ray", "not-an-address"], {}),
    ):
        run = _recycle(str(job), "--max-failures", "1", "-o", str(out), *flags, env={**os.environ, **env})
        stdout, stderr = run.communicate(timeout=30)
        assert run.returncode == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "--ray/RECYCLE_RAY_ADDRESS" in lines[0], stderr
        assert stdout == ""
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written, nothing torn
    # resumed through Ray Client (ray://) when ray[client] is installed, else at HOST:PORT
    address = cluster.client_address if importlib.util.find_spec("grpc") else cluster.address
    resumed = _recycle(str(job), "--max-failures", "1", "-o", str(out), "--ray", address, "--no-progress")
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    assert "1 already cached, 4 planned now" in stdout, stdout


@pytest.mark.timeout(60)
def test_a_scenario_whose_task_raises_is_reported_once_and_the_others_are_written(
    cluster: LocalRayCluster, caplog: pytest.LogCaptureFixture
) -> None:
    import ray

    good = [FailureScenario(failed=[]), FailureScenario(failed=[(0, 1)])]
    bad = FailureScenario(failed=[(0, 9)])  # outside the grid: the planner raises InvalidInputError
    got: list[dict[str, object]] = []
    try:
        with pytest.raises(ScenariosFailed, match=r"1 scenario.*failed \[\[0, 9\]\]: InvalidInputError"):
            plan_on_ray(
                cluster.address, JOB.model_dump_json(), [good[0], bad, good[1]], False, 3.0, got.append
            )
    finally:
        ray.shutdown()
    assert len(got) == 2  # the others were planned and handed on
    assert "submitting it again" not in caplog.text  # not retried: the same error every time
    assert caplog.text.count("a scenario failed") == 1


@pytest.mark.timeout(90)
def test_ctrl_c_leaves_a_directory_a_second_run_completes(cluster: LocalRayCluster, tmp_path: Path) -> None:
    job, out, run = _start(tmp_path, cluster.address, "plans")
    deadline = time.monotonic() + 60
    while len(list(out.glob("*.json"))) < 3:  # interrupted once a few plans are written
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.02)
    run.send_signal(signal.SIGINT)
    stdout, stderr = run.communicate(timeout=30)
    written = len(list(out.glob("*.json")))
    assert run.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("interrupted: the plans written so far stay"), stderr
    assert 3 <= written < 69 and not list(out.glob("index-*"))
    again = _recycle(
        str(job), "--max-failures", "3", "-o", str(out), "--ray", cluster.address, "--no-progress"
    )
    stdout, stderr = again.communicate(timeout=60)
    assert again.returncode == 0, stderr
    assert f"{written} already cached, {69 - written} planned now" in stdout, stdout
    assert list(out.glob("index-*"))


@pytest.mark.timeout(60)
def test_a_port_that_is_no_ray_head_is_refused_within_the_deadline() -> None:
    """A port that accepts TCP but is no Ray head's (the dashboard's, an HTTP server): `ray.init` in
    the process retried for minutes, flooding stderr and ignoring SIGTERM; now a trial connection in
    a child process is killed at its deadline and the answer is one line."""
    import socket

    from planner.errors import InvalidInputError
    from whatif.precompute_ray import trial_connect

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(InvalidInputError, match=r"no Ray head answered within 3 s"):
            trial_connect(address, timeout_s=3.0)
        assert time.monotonic() - t0 < 10
