"""The `finished` state over HTTP: workers post `done` with their worker token, the job turns finished
once every alive worker is done, is never declared failed for their silence, refuses later events
with 409, and answers a retried `done` the same way."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from api.main import create_app
from api.settings import Settings
from tests.test_api_endpoints import CTL, TINY

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("data"),
        controller_token="controller-secret",  # type: ignore[arg-type]
        precompute_time_limit_s=1.0,
        refine_time_limit_s=1.0,
        heartbeat_check_s=0.1,
        max_wait_s=5.0,
    )
    with TestClient(create_app(settings)) as c:
        yield c


def new_job(client: TestClient) -> tuple[str, dict[str, str]]:
    body = {"job": TINY, "heartbeat_timeout_s": TIMEOUT_S}
    r = client.post("/v1/jobs", json=body, headers=CTL)
    assert r.status_code == 201, r.text
    return r.json()["id"], {"Authorization": f"Bearer {r.json()['worker_token']}"}


def done(client: TestClient, job_id: str, headers: dict[str, str], event_id: str, *workers: list[int]) -> Any:
    body = {"event_id": event_id, "kind": "done", "workers": list(workers)}
    return client.post(f"/v1/jobs/{job_id}/events", json=body, headers=headers)


def test_done_workers_finish_the_job_and_are_never_failed_for_silence(client: TestClient) -> None:
    job_id, worker = new_job(client)
    everyone = [[d, s] for d in range(3) for s in range(2)]
    for i, w in enumerate(everyone):
        poll = client.get(f"/v1/jobs/{job_id}/schedule?worker={w[0]},{w[1]}", headers=worker)
        assert poll.status_code == 200  # a heartbeat: the worker is tracked from here on
        before = client.get(f"/v1/jobs/{job_id}", headers=CTL).json()["version"]
        r = done(client, job_id, worker, f"done-{i}", w)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["changed"] is False and answer["failed"] == [] and answer["replayed"] is False
        last = i == len(everyone) - 1
        assert answer["state"] == ("finished" if last else "running")
        if last:  # only the last one publishes a version (a background CP-SAT plan may come between)
            assert answer["version"] > before
    doc = client.get(f"/v1/jobs/{job_id}", headers=CTL).json()
    finished = answer["version"]
    assert doc["state"] == "finished" and doc["done"] == everyone and doc["version"] == finished
    view = client.get(f"/v1/jobs/{job_id}/schedule?worker=0,0&after_version=0", headers=worker).json()
    assert view["state"] == "finished" and view["version"] == finished and view["alive"]
    time.sleep(TIMEOUT_S * 2.5)  # well past the heartbeat timeout: nobody polls any more
    doc = client.get(f"/v1/jobs/{job_id}", headers=CTL).json()
    assert doc["state"] == "finished" and doc["failed"] == [] and doc["heartbeat_enabled"] is True
    assert doc["version"] == finished  # no later version: not failed, not refined
    listed = client.get("/v1/jobs", headers=CTL).json()["jobs"]
    assert {j["id"]: j["state"] for j in listed}[job_id] == "finished"
    page = client.get(f"/jobs/{job_id}", headers=worker)
    assert page.status_code == 200 and '<span class="ok">finished</span>' in page.text


def test_events_after_finished_are_409_and_a_retried_done_answers_the_same(client: TestClient) -> None:
    job_id, worker = new_job(client)
    everyone = [[d, s] for d in range(3) for s in range(2)]
    first = done(client, job_id, worker, "all-done", *everyone)
    assert first.status_code == 200 and first.json()["state"] == "finished"
    again = done(client, job_id, worker, "all-done", *everyone)  # the worker's retry: same event_id
    assert again.status_code == 200 and again.json() == {**first.json(), "replayed": True}
    other = done(client, job_id, worker, "second-try", [1, 1])  # a new id for a done worker: a no-op
    assert other.status_code == 200
    assert {k: other.json()[k] for k in ("state", "version", "changed")} == {
        "state": "finished",
        "version": first.json()["version"],
        "changed": False,
    }
    for kind, extra in (("fail", {}), ("rejoin", {}), ("slow", {"factor": 2.0})):
        body = {"event_id": f"late-{kind}", "kind": kind, "workers": [[0, 0]], **extra}
        r = client.post(f"/v1/jobs/{job_id}/events", json=body, headers=CTL)
        assert r.status_code == 409 and r.json()["error"] == "job_finished", r.text
        assert "finished" in r.json()["detail"]
    assert client.get(f"/v1/jobs/{job_id}", headers=CTL).json()["version"] == first.json()["version"]


def test_done_from_a_failed_worker_and_worker_token_rules(client: TestClient) -> None:
    job_id, worker = new_job(client)
    other_id, _ = new_job(client)
    fail = {"event_id": "f", "kind": "fail", "workers": [[2, 1]]}
    assert client.post(f"/v1/jobs/{job_id}/events", json=fail, headers=CTL).status_code == 200
    r = done(client, job_id, worker, "late", [2, 1])
    assert r.status_code == 409 and r.json()["error"] == "worker_failed"
    replay = client.post(f"/v1/jobs/{job_id}/events", json=fail, headers=worker)  # every kind: an agent's
    assert replay.status_code == 200 and replay.json()["replayed"] is True
    assert done(client, other_id, worker, "x", [0, 0]).status_code == 403  # another job's token
    assert done(client, job_id, worker, "off", [5, 0]).status_code == 422  # off the grid
    assert done(client, job_id, CTL, "by-controller", [0, 0]).status_code == 200  # an agent may post it
    doc = client.get(f"/v1/jobs/{job_id}", headers=CTL).json()
    assert doc["state"] == "running" and doc["done"] == [[0, 0]] and doc["failed"] == [[2, 1]]


def test_heartbeat_poll_wait_is_capped_at_a_third_of_the_timeout(client: TestClient) -> None:
    job_id, worker = new_job(client)
    assert client.get(f"/v1/jobs/{job_id}", headers=CTL).json()["poll_wait_max_s"] == pytest.approx(1 / 3)
    url = f"/v1/jobs/{job_id}/schedule?worker=0,1&after_version=1&wait=30"
    t0 = time.monotonic()
    r = client.get(url, headers=worker)
    assert r.status_code == 304 and time.monotonic() - t0 < 2.0
    assert float(r.headers["recycle-poll-wait-max"]) == pytest.approx(1 / 3, rel=1e-3)
    r = client.get(f"/v1/jobs/{job_id}/schedule?after_version=1&wait=0", headers=CTL)
    assert float(r.headers["recycle-poll-wait-max"]) == 5.0  # not a heartbeat: RECYCLE_MAX_WAIT_S
    assert done(client, job_id, worker, "d", [0, 1]).status_code == 200
    for _ in range(3):  # a done worker's polls are plain reads: it is not tracked again
        client.get(f"/v1/jobs/{job_id}/schedule?worker=0,1", headers=worker)
    time.sleep(TIMEOUT_S * 2)
    assert client.get(f"/v1/jobs/{job_id}", headers=CTL).json()["failed"] == []


def test_a_heartbeat_fail_decided_before_a_done_or_a_poll_fails_nobody(client: TestClient) -> None:
    """The heartbeat loop picks its silent workers without the job's lock; a `done` (or a poll) that
    lands before its `fail` is applied takes the worker out of it: a completed worker is never failed."""
    from api.models import EventIn

    job_id, worker = new_job(client)
    for w in ([0, 0], [1, 0]):
        assert (
            client.get(f"/v1/jobs/{job_id}/schedule?worker={w[0]},{w[1]}", headers=worker).status_code == 200
        )
    assert done(client, job_id, worker, "done-0", [0, 0]).status_code == 200
    service = client.app.state.service  # type: ignore[attr-defined]
    before = client.get(f"/v1/jobs/{job_id}", headers=CTL).json()["version"]

    async def late_fail() -> tuple[dict[str, object], list[int]]:
        event = EventIn(
            event_id="heartbeat-late", kind="fail", workers=[[0, 0], [1, 0]], reason="heartbeat timeout"
        )
        return await service.apply_event(job_id, event, still_silent=True)

    result, _ = client.portal.call(late_fail)  # type: ignore[union-attr]
    doc = client.get(f"/v1/jobs/{job_id}", headers=CTL).json()
    assert doc["failed"] == [] and result["changed"] is False and doc["version"] == before, (doc, result)
