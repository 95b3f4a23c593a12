"""GET /v1/jobs (listing), POST /v1/jobs with an Idempotency-Key (also across a restart), and which
schedule polls are heartbeats (worker-token polls only, never the controller's)."""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from api.main import create_app
from api.records import JobRecord
from api.settings import Settings
from tests.jobs import service_job_doc

pytestmark = pytest.mark.timeout(120)

TINY: dict[str, Any] = service_job_doc(3, 2, 2)
CTL = {"Authorization": "Bearer controller-secret"}


def make_client(data_dir: Path, **extra: Any) -> TestClient:
    extra.setdefault("controller_token", "controller-secret")
    settings = Settings(
        data_dir=data_dir,
        precompute_time_limit_s=1.0,
        refine_time_limit_s=1.0,
        heartbeat_timeout_s=0.5,
        heartbeat_check_s=0.1,
        max_wait_s=2.0,
        **extra,
    )
    return TestClient(create_app(settings))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with make_client(tmp_path_factory.mktemp("data")) as c:
        yield c


def register(client: TestClient, key: str | None = None, **extra: Any) -> Any:
    headers = dict(CTL) if key is None else {**CTL, "Idempotency-Key": key}
    return client.post("/v1/jobs", json={"job": TINY, "heartbeat_enabled": False, **extra}, headers=headers)


def test_list_jobs_newest_first_in_pages(client: TestClient) -> None:
    ids = [register(client).json()["id"] for _ in range(5)]
    fail = {"event_id": "f", "kind": "fail", "workers": [[1, 0]]}
    assert client.post(f"/v1/jobs/{ids[2]}/events", json=fail, headers=CTL).status_code == 200
    seen: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        r = client.get("/v1/jobs", params=params, headers=CTL)
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["jobs"]) <= 2
        seen += page["jobs"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    listed = [j["id"] for j in seen]
    assert len(listed) == len(set(listed)) and listed[: len(ids)] == ids[::-1]  # newest first
    created = [j["created_at"] for j in seen]
    assert created == sorted(created, reverse=True)
    by_id = {j["id"]: j for j in seen}
    assert by_id[ids[2]]["failed"] == [[1, 0]] and by_id[ids[2]]["version"] == 2
    assert by_id[ids[0]] | {"created_at": 0} == {
        "id": ids[0], "name": "tiny-d3p2", "created_at": 0, "state": "running", "version": 1,
        "num_pipelines": 3, "num_stages": 2, "failed": [],
    }  # fmt: skip


def test_list_jobs_auth_and_bounds(client: TestClient) -> None:
    worker = {"Authorization": f"Bearer {register(client).json()['worker_token']}"}
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers=worker).status_code == 403
    for bad in ({"limit": 0}, {"limit": 501}, {"cursor": "no-such-job"}):
        assert client.get("/v1/jobs", params=bad, headers=CTL).status_code == 422, bad
    assert client.get("/v1/jobs", params={"limit": 500}, headers=CTL).status_code == 200


def test_idempotency_key_replays_first_answer(client: TestClient) -> None:
    first = register(client, key="launch-0001-3f9a2c")
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    again = register(client, key="launch-0001-3f9a2c")
    assert again.status_code == 201 and again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"
    # the replayed worker token works: same job
    token = {"Authorization": f"Bearer {again.json()['worker_token']}"}
    assert client.get(f"/v1/jobs/{first.json()['id']}", headers=token).status_code == 200
    other = register(client, key="launch-0001-3f9a2c", max_failures=1)  # same key, another body
    assert other.status_code == 422 and "different request body" in other.json()["detail"]
    assert register(client, key="launch-0002-8b1d4e").json()["id"] != first.json()["id"]
    assert register(client).json()["id"] != register(client).json()["id"]  # no key: a job each time
    for bad in ("", "short-key-15chr", "x" * 256, "has space padding"):
        assert register(client, key=bad).status_code == 422


def test_idempotency_key_survives_a_restart(tmp_path: Path) -> None:
    with make_client(tmp_path) as c:
        first = register(c, key="key-restart-5e7c1a")
        assert first.status_code == 201
    db = sqlite3.connect(tmp_path / "recycle.sqlite3")
    stored = " ".join(str(v) for row in db.execute("SELECT * FROM idempotency") for v in row)
    db.close()
    assert (
        first.json()["worker_token"] not in stored and "key-restart-5e7c1a" not in stored
    )  # neither in clear
    with make_client(tmp_path) as c:
        again = register(c, key="key-restart-5e7c1a")
        assert again.status_code == 201 and again.json() == first.json()
        assert register(c, key="key-restart-5e7c1a", max_failures=0).status_code == 422
        assert len(c.get("/v1/jobs", headers=CTL).json()["jobs"]) == 1


def wait_failed(client: TestClient, job_id: str, seconds: float) -> list[Any]:
    deadline = time.monotonic() + seconds
    while True:
        failed: list[Any] = client.get(f"/v1/jobs/{job_id}", headers=CTL).json()["failed"]
        if failed or time.monotonic() > deadline:
            return failed
        time.sleep(0.1)


def test_controller_poll_is_not_a_heartbeat(client: TestClient) -> None:
    job_id = register(client, heartbeat_enabled=True).json()["id"]
    url = f"/v1/jobs/{job_id}/schedule"
    assert client.get(f"{url}?worker=2,0", headers=CTL).status_code == 200  # fast path
    assert client.get(f"{url}?worker=1,1&after_version=0000000000000000000", headers=CTL).status_code == 200
    assert wait_failed(client, job_id, 1.5) == []  # three timeouts later: nobody declared failed


def test_worker_poll_is_a_heartbeat(client: TestClient) -> None:
    created = register(client, heartbeat_enabled=True).json()
    worker = {"Authorization": f"Bearer {created['worker_token']}"}
    assert client.get(f"/v1/jobs/{created['id']}/schedule?worker=2,0", headers=worker).status_code == 200
    assert wait_failed(client, created["id"], 10) == [[2, 0]]


def test_insecure_dev_counts_worker_token_polls_only(tmp_path: Path) -> None:
    with make_client(tmp_path, controller_token=None, insecure_dev=True) as c:
        created = c.post("/v1/jobs", json={"job": TINY}).json()
        url = f"/v1/jobs/{created['id']}/schedule?worker=0,1"
        assert c.get(url).status_code == 200  # no token: allowed, not a heartbeat
        assert wait_failed(c, created["id"], 1.2) == []
        assert c.get(url, headers={"Authorization": f"Bearer {created['worker_token']}"}).status_code == 200
        assert wait_failed(c, created["id"], 10) == [[0, 1]]


def test_a_job_no_schedule_fits_is_not_stored_and_its_key_stays_free(tmp_path: Path) -> None:
    """The first plan's 422 had stored the job anyway (version 0: polls answered 304 forever), used
    up its Idempotency-Key (the corrected retry was `idempotency_key_reused`) and the service then
    refused to start on that data directory."""
    key = "launch-too-small-4c1e8b"
    with make_client(tmp_path) as c:
        r = register(c, key=key, job={**TINY, "memory_capacity_mib": 8.0})  # 10 MiB per activation
        assert r.status_code == 422 and "no schedule fits" in r.json()["detail"], r.text
        assert c.get("/v1/jobs", headers=CTL).json()["jobs"] == []
        again = register(c, key=key)
        assert again.status_code == 201 and "idempotent-replayed" not in again.headers, again.text
    with make_client(tmp_path) as c:
        assert [j["version"] for j in c.get("/v1/jobs", headers=CTL).json()["jobs"]] == [1]


def test_a_stored_job_the_planner_refuses_does_not_stop_the_service_starting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A data directory holding a job without a version that no schedule fits (left by an older
    service): start-up plans the others and says which job it could not."""
    with make_client(tmp_path) as c:
        good = register(c).json()["id"]
        spec = {**TINY, "memory_capacity_mib": 8.0}
        bad = JobRecord("0badc0ffee000001", "too-small", json.dumps(spec), "0" * 64, time.time())
        c.app.state.service.store.create_job(bad)  # type: ignore[attr-defined]
    with make_client(tmp_path) as c:
        jobs = {j["id"]: j["version"] for j in c.get("/v1/jobs", headers=CTL).json()["jobs"]}
        assert jobs == {good: 1, bad.id: 0}
        assert register(c).status_code == 201
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(bad.id in m and "no schedule fits" in m for m in said), said


def test_a_replay_starts_the_precompute_a_failed_first_attempt_never_started(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    import api.routes.jobs as routes

    key = "launch-lost-answer-7d2e91"
    with monkeypatch.context() as m:  # the first attempt commits the job, then dies before precompute
        m.setattr(routes, "_start_precompute", lambda *args: None)
        first = register(client, key=key)
    job = f"/v1/jobs/{first.json()['id']}"
    assert client.get(job, headers=CTL).json()["precompute"]["total"] == 0
    assert register(client, key=key).json() == first.json()
    deadline = time.monotonic() + 60
    while client.get(job, headers=CTL).json()["precompute"]["total"] == 0:
        assert time.monotonic() < deadline, "the replay did not start the precompute"
        time.sleep(0.05)


def test_precompute_names_the_keys_whose_solve_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key whose solve failed counted as done and nothing said so: `failed` names how many."""
    import api.background as background

    real = background._solve
    failing: list[str] = []
    ours: list[Any] = []  # this test's service: another test's (a module client's) may still precompute

    async def fail_first(service: Any, rt: Any, key: str, sc: Any, limit: float) -> bool:
        if service is not ours[0]:
            return await real(service, rt, key, sc, limit)
        if not failing:
            failing.append(key)
        return False if key in failing else await real(service, rt, key, sc, limit)

    monkeypatch.setattr(background, "_solve", fail_first)
    with make_client(tmp_path / "d") as c:
        ours.append(c.app.state.service)  # type: ignore[attr-defined]
        job_id = register(c, max_failures=1).json()["id"]
        deadline = time.monotonic() + 60
        while True:
            pre = c.get(f"/v1/jobs/{job_id}", headers=CTL).json()["precompute"]
            if (pre["total"] and pre["done"] == pre["total"]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert pre["done"] == pre["total"] > 1 and pre["failed"] == 1, pre
        store = c.app.state.service.store  # type: ignore[attr-defined]
        assert failing[0] not in store.plan_keys(failing)
