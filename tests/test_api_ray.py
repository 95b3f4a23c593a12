"""The service's background precompute on a real two-node Ray cluster (RECYCLE_RAY_ADDRESS).

One cluster for the module (bench/precompute_ray_cluster.py: a head and a second node, one CPU each).
The in-process app precomputes a job on Ray with the second node SIGKILLed while it runs a solve:
every key is stored (the lost solve was submitted again) and the plans are the local solver's. Then
the head is killed mid-precompute: the service goes on, falls back to its local pool and finishes.
`recycle serve` with an unreachable address is one line and exit 2 (no cluster needed).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from pydantic import SecretStr

from api.main import create_app
from api.settings import Settings
from api.solve_partition import REPARTITION_PLANS
from api.solver import enumerate_scenarios, solve
from api.solver_ray import ATTEMPT_SLACK_S, attempt_budget_s
from bench.precompute_ray_cluster import LocalRayCluster, process_titles
from planner.normalize import normalize
from tests.jobs import service_job

CTL = {"Authorization": "Bearer controller-secret"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    with LocalRayCluster(nodes=2, cpus=1) as c:
        yield c


@pytest.fixture
def client(
    cluster: LocalRayCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> TestClient:
    """The in-process app (not started yet) with RECYCLE_RAY_ADDRESS set to the cluster's address."""
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv("RECYCLE_RAY_ADDRESS", cluster.address)
    token = SecretStr("controller-secret")
    settings = Settings(data_dir=tmp_path, controller_token=token, precompute_time_limit_s=1.0)
    return TestClient(create_app(settings))


def _register(client: TestClient, job: Any, max_failures: int) -> str:
    body = {"job": job.model_dump(mode="json", exclude_none=True), "max_failures": max_failures}
    r = client.post("/v1/jobs", json={**body, "heartbeat_enabled": False}, headers=CTL)
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def _precompute(client: TestClient, job_id: str) -> dict[str, int]:
    return dict(client.get(f"/v1/jobs/{job_id}", headers=CTL).json()["precompute"])


def _wait(what: str, ok: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_repartition_choice_gets_a_budget_for_each_plan_it_makes() -> None:
    """plan_repartition plans up to REPARTITION_PLANS candidates within the limit each: a budget of
    one plan declared such a solve lost (and ran it again) while it was still planning."""
    base = ("{}", "{}", 30.0, True)
    assert attempt_budget_s(base) == 60.0 + ATTEMPT_SLACK_S
    assert attempt_budget_s((*base, False, None)) == 60.0 + ATTEMPT_SLACK_S
    assert attempt_budget_s((*base, True)) == REPARTITION_PLANS * 60.0 + ATTEMPT_SLACK_S
    assert attempt_budget_s((*base, True, "[[0, 1], [1, 4]]")) == 60.0 + ATTEMPT_SLACK_S  # a refinement


def test_a_port_that_is_no_ray_head_is_one_line_and_leaves_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """`recycle serve`'s check connects a driver: a port that listens but is no Ray head's (the
    dashboard's, say) passed the TCP probe, then hung the start-up and failed it with a traceback; a
    driver still connecting when START_TIMEOUT_S ran out was left running."""
    import multiprocessing
    import socket

    import api.solver_ray as solver_ray

    monkeypatch.setattr(solver_ray, "START_TIMEOUT_S", 1.0)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # accepts TCP, speaks no Ray
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setenv("RECYCLE_RAY_ADDRESS", address)
        problem = solver_ray.check_ray()
    assert problem == f"RECYCLE_RAY_ADDRESS {address}: no connection after 1 s"
    assert not [p for p in multiprocessing.active_children() if p.name == "recycle-ray-driver"]


@pytest.mark.timeout(90)
def test_a_task_past_its_budget_is_cancelled_on_the_cluster(
    cluster: LocalRayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A solve that does not answer within its budget is submitted again, and the late one is
    cancelled: left running, it held a CPU (and delayed the retries) until it ended by itself."""
    import multiprocessing

    import ray

    import api.solver_ray as solver_ray

    def slow(*_: Any) -> None:  # stands in for a solve that takes far longer than its budget
        time.sleep(120)

    monkeypatch.setattr(solver_ray, "ATTEMPT_SLACK_S", 1.0)  # budget 2 x 0.5 + 1 s
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    here, there = multiprocessing.Pipe()
    try:
        driver = solver_ray._Driver(ray, there, None)
        driver.task = ray.remote(num_cpus=1, max_retries=0)(slow)
        runner = threading.Thread(target=driver.run, daemon=True)
        runner.start()
        here.send((7, ("{}", "{}", 0.5, True)))
        answers: list[Any] = []
        while not answers or answers[-1][0] == "warn":
            assert here.poll(30), answers
            answers.append(here.recv())
        assert [a[0] for a in answers] == ["warn"] * 3 + ["fail"], answers
        assert answers[-1][1] == 7 and "no answer in time" in answers[-1][2]

        def idle() -> bool:
            return not any("ray::slow" in t for g in cluster.groups for t in process_titles(g))

        _wait("the late tasks cancelled", idle, 20)
        here.send(None)
        runner.join(timeout=10)
    finally:
        ray.shutdown()


@pytest.mark.timeout(120)
def test_precompute_on_ray_loses_nothing_when_a_node_dies_and_plans_as_locally(
    cluster: LocalRayCluster, client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    job = service_job(4, 3, 4)  # 13 keys up to 2 failures, ~0.3-1 s each
    keys = [normalize(job, sc).key for sc in enumerate_scenarios(job, 2, 2000)]
    with client:
        solver = client.app.state.service.solver  # type: ignore[attr-defined]
        assert solver.ray is not None and solver.ray.alive and solver.background_slots == 2
        job_id = _register(client, job, 2)
        # SIGKILL the second node while it runs a solve (Ray titles a busy worker after its task)
        _wait(
            "a solve on the second node",
            lambda: any("ray::solve" in t for t in process_titles(cluster.groups[1])),
        )
        cluster.kill_node(1)
        assert _precompute(client, job_id)["done"] < len(keys)
        _wait(
            "the precompute",
            lambda: (p := _precompute(client, job_id))["done"] == p["total"] == len(keys),
            90,
        )
        store = client.app.state.service.store  # type: ignore[attr-defined]
        assert store.plan_keys(keys) == set(keys)  # nothing given up: the lost solve was redone
        assert solver.ray.alive and solver.ray.tasks >= len(keys)  # all on Ray (retries inside)
        driver = solver.ray._proc
        stored = {k: store.get_plan(k) for k in keys}
    assert "submitting it again (retry 1 of 3)" in caplog.text, caplog.text
    assert driver.exitcode == 0  # shut down cleanly (ray.shutdown), not terminated
    for sc in enumerate_scenarios(job, 2, 2000)[:4]:
        local = solve(job.model_dump_json(), sc.model_dump_json(), 1.0, True)
        plan = stored[local.key]
        assert plan is not None and plan.iteration_time_ms == pytest.approx(local.iteration_time_ms)


@pytest.mark.timeout(240)
def test_a_lost_head_falls_back_to_the_local_pool_and_the_precompute_finishes(
    cluster: LocalRayCluster, client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    job = service_job(4, 3, 5)
    with client:
        solver = client.app.state.service.solver  # type: ignore[attr-defined]
        job_id = _register(client, job, 2)
        _wait("a first plan", lambda: _precompute(client, job_id)["done"] >= 1)
        cluster.kill_node(0)
        # The driver's probe thread notices within ~PROBE_MISSES s, even when a Ray call of the driver
        # blocks on the dead head (up to Ray's 60 s GCS reconnect timeout; 30 s failed twice under CI
        # load when the probe shared its loop with those calls).
        _wait("the fallback", lambda: not solver.ray.alive, 30)
        assert solver.background_slots == 1
        _wait("the precompute", lambda: (p := _precompute(client, job_id))["done"] == p["total"] > 0, 90)
        tasks = solver.ray.tasks
        keys = [normalize(job, sc).key for sc in enumerate_scenarios(job, 2, 2000)]
        store = client.app.state.service.store  # type: ignore[attr-defined]
        assert store.plan_keys(keys) == set(keys)  # the solves in flight on Ray were run locally
    assert "fall back to the local pool" in caplog.text, caplog.text
    assert 1 <= tasks < len(keys)


def test_serve_with_an_unreachable_ray_address_or_without_ray_is_one_line_and_exit_2(tmp_path: Path) -> None:
    serve = ["--port", "0", "--insecure-dev", "--data-dir", str(tmp_path)]
    without_ray = "import sys; sys.modules['ray'] = None; from api.cli import main; sys.exit(main())"
    for address, command, says in (
        ("127.0.0.1:1", ["-m", "api.cli"], "no Ray cluster reachable at 127.0.0.1:1"),
        ("not-an-address", ["-m", "api.cli"], "expected auto, HOST:PORT or ray://HOST:PORT"),
        ("127.0.0.1:1", ["-c", without_ray], "Ray is not installed"),  # `import ray` fails as without it
    ):
        run = subprocess.run(
            [sys.executable, *command, *serve],
            env={**os.environ, "RECYCLE_RAY_ADDRESS": address},
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, run.stderr
        assert lines[0].startswith("error: RECYCLE_RAY_ADDRESS") and says in lines[0], lines
    assert not any(tmp_path.iterdir())  # nothing started: no store was created
