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
from api.solver import enumerate_scenarios, solve
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


@pytest.mark.timeout(120)
def test_a_lost_head_falls_back_to_the_local_pool_and_the_precompute_finishes(
    cluster: LocalRayCluster, client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    job = service_job(4, 3, 5)
    with client:
        solver = client.app.state.service.solver  # type: ignore[attr-defined]
        job_id = _register(client, job, 2)
        _wait("a first plan", lambda: _precompute(client, job_id)["done"] >= 1)
        cluster.kill_node(0)
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
