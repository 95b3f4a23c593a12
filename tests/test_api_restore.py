"""Service-owned restores over HTTP: checkpoint events, the auto restore version (the newest complete
checkpoint iteration, or null), restore policy manual, persistence across a restart of the service,
liveness after a restore (grace, then the heartbeat), `joined_at` (fencing), and what a job's worker
token may post."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from api.main import create_app
from api.settings import Settings
from api.store import SQLiteStore
from tests.test_api_endpoints import CTL, TINY

pytestmark = pytest.mark.timeout(120)

STAGE_1 = [[0, 1], [1, 1], [2, 1]]  # TINY is D=3 x P=2
EVERYONE = [[d, s] for d in range(3) for s in range(2)]


def settings(data: Path, **kw: Any) -> Settings:
    values: dict[str, Any] = {
        "data_dir": data,
        "controller_token": "controller-secret",
        "precompute_time_limit_s": 1.0,
        "refine_time_limit_s": 1.0,
        "heartbeat_check_s": 0.1,
        "max_wait_s": 2.0,
        **kw,
    }
    return Settings(**values)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with TestClient(create_app(settings(tmp_path_factory.mktemp("data")))) as c:
        yield c


def new_job(client: TestClient, **extra: Any) -> tuple[str, dict[str, str]]:
    r = client.post("/v1/jobs", json={"job": TINY, "heartbeat_enabled": False, **extra}, headers=CTL)
    assert r.status_code == 201, r.text
    return r.json()["id"], {"Authorization": f"Bearer {r.json()['worker_token']}"}


def post(client: TestClient, job_id: str, headers: dict[str, str], event_id: str, kind: str,
         workers: list[list[int]], **kw: Any) -> Any:  # fmt: skip
    body = {"event_id": event_id, "kind": kind, "workers": workers, **kw}
    return client.post(f"/v1/jobs/{job_id}/events", json=body, headers=headers)


def job(client: TestClient, job_id: str) -> dict[str, Any]:
    r = client.get(f"/v1/jobs/{job_id}", headers=CTL)
    assert r.status_code == 200, r.text
    return dict(r.json())


def view(client: TestClient, job_id: str, headers: dict[str, str], w: list[int] | None = None) -> Any:
    q = "" if w is None else f"?worker={w[0]},{w[1]}"
    r = client.get(f"/v1/jobs/{job_id}/schedule{q}", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def test_checkpoint_events_make_no_version_and_give_the_restorable_iteration(client: TestClient) -> None:
    job_id, worker = new_job(client)
    doc = job(client, job_id)
    assert doc["restore_policy"] == "auto" and doc["restore"] is None
    assert doc["checkpoints"] == {} and doc["restorable_iteration"] is None
    r = post(client, job_id, worker, "c0-2", "checkpoint", [[0, 0]], iteration=2)
    assert r.status_code == 200, r.text
    assert (
        r.json()["changed"] is False and r.json()["version"] == 1 and r.json()["restorable_iteration"] is None
    )
    r = post(client, job_id, CTL, "c1-2", "checkpoint", [[1, 1]], iteration=2)  # the controller may too
    assert r.json()["restorable_iteration"] == 2
    again = post(client, job_id, worker, "c1-2", "checkpoint", [[1, 1]], iteration=2)
    assert again.status_code == 200 and again.json() == {**r.json(), "replayed": True}
    assert post(client, job_id, worker, "c1-2", "checkpoint", [[1, 1]], iteration=4).status_code == 409
    for k in (4, 6, 8, 10):
        assert post(client, job_id, worker, f"c0-{k}", "checkpoint", [[0, 0]], iteration=k).status_code == 200
    post(client, job_id, worker, "c1-8", "checkpoint", [[2, 1]], iteration=8)
    doc = job(client, job_id)
    assert doc["checkpoints"] == {"0": [6, 8, 10], "1": [2, 8]}  # the newest 3 per stage
    assert doc["restorable_iteration"] == 8 and doc["version"] == 1 and doc["state"] == "running"
    for body in (
        {"kind": "checkpoint", "workers": [[0, 0]]},  # no iteration
        {"kind": "checkpoint", "workers": [[0, 0]], "iteration": -1},
        {"kind": "fail", "workers": [[0, 0]], "iteration": 3},  # only checkpoint takes one
        {"kind": "checkpoint", "workers": [[5, 0]], "iteration": 3},  # off the grid
    ):
        r = client.post(f"/v1/jobs/{job_id}/events", json={"event_id": "bad", **body}, headers=worker)
        assert r.status_code == 422, (body, r.text)
    post(client, job_id, CTL, "f", "fail", [[2, 0]])
    r = post(client, job_id, worker, "late", "checkpoint", [[2, 0]], iteration=12)
    assert r.status_code == 409 and r.json()["error"] == "worker_failed"


def test_auto_restore_publishes_the_restore_version_with_the_newest_complete_checkpoint(
    client: TestClient,
) -> None:
    job_id, worker = new_job(client)
    assert post(client, job_id, CTL, "slow", "slow", [[0, 0]], factor=1.5).status_code == 200
    for i, (w, k) in enumerate((([0, 0], 2), ([1, 0], 4), ([2, 1], 2), ([0, 1], 3))):
        assert post(client, job_id, worker, f"c{i}", "checkpoint", [w], iteration=k).status_code == 200
    assert post(client, job_id, CTL, "one", "fail", [[1, 1]]).json()["version"] == 3
    r = post(client, job_id, worker, "lost", "fail", [[0, 1], [2, 1]])  # the agent's token
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["state"] == "running" and answer["failed"] == [] and answer["changed"] is True
    assert answer["unrecoverable_stages"] == [1] and answer["needs_restore_version"] == 4
    assert answer["version"] == 5 and answer["restore"] == {"epoch": 1, "iteration": 2}
    replay = post(client, job_id, worker, "lost", "fail", [[0, 1], [2, 1]])
    assert replay.status_code == 200 and replay.json() == {**answer, "replayed": True}
    doc = job(client, job_id)
    assert doc["state"] == "running" and doc["failed"] == [] and doc["version"] == 5
    assert doc["slow"] == [{"worker": [0, 0], "factor": 1.5}] and doc["unrecoverable_stages"] == []
    assert doc["restore"] == {"epoch": 1, "iteration": 2}
    history = client.app.state.service.store.list_versions(job_id)  # type: ignore[attr-defined]
    assert [(v, src, cause) for v, src, _, cause, _ in history[3:]] == [
        (4, "needs_restore", "lost"),
        (5, history[4][1], "lost"),
    ]
    full = view(client, job_id, CTL)
    assert full["restore"] == {"epoch": 1, "iteration": 2} and full["restore_policy"] == "auto"
    assert full["joined_at"] == {f"{d},{s}": 5 for d, s in EVERYONE}
    for w in EVERYONE:
        v = view(client, job_id, worker, w)
        assert v["alive"] and v["joined_at"] == 5 and v["restore"] == {"epoch": 1, "iteration": 2}
    # every later version carries the restore; a second lost stage restores again (epoch 2)
    assert post(client, job_id, CTL, "later", "fail", [[2, 0]]).json()["version"] == 6
    v = view(client, job_id, worker, [1, 0])
    assert v["version"] == 6 and v["restore"] == {"epoch": 1, "iteration": 2} and v["joined_at"] == 5
    assert "joined_at" not in view(client, job_id, worker, [2, 0])  # a failed worker: none
    r = post(client, job_id, CTL, "lost-0", "fail", [[0, 0], [1, 0]])
    assert r.status_code == 200 and r.json()["restore"] == {"epoch": 2, "iteration": 2}


def test_no_complete_checkpoint_restores_from_the_initial_parameters(client: TestClient) -> None:
    job_id, worker = new_job(client)
    post(client, job_id, worker, "c0", "checkpoint", [[0, 0]], iteration=2)  # stage 1 reported none
    r = post(client, job_id, CTL, "lost", "fail", STAGE_1)
    assert r.status_code == 200 and r.json()["restore"] == {"epoch": 1, "iteration": None}, r.text
    assert view(client, job_id, worker, [0, 1])["restore"] == {"epoch": 1, "iteration": None}


def test_manual_policy_keeps_needs_restore_until_rejoins(client: TestClient) -> None:
    job_id, worker = new_job(client, restore_policy="manual")
    r = post(client, job_id, worker, "lost", "fail", STAGE_1)
    assert r.status_code == 409 and r.json()["error"] == "unrecoverable" and r.json()["stages"] == [1]
    doc = job(client, job_id)
    assert doc["state"] == "needs_restore" and doc["restore"] is None and doc["restore_policy"] == "manual"
    v = view(client, job_id, worker, [0, 0])
    assert v["state"] == "needs_restore" and v["restore_policy"] == "manual" and "restore" not in v
    r = post(client, job_id, worker, "back", "rejoin", STAGE_1)
    assert (
        r.status_code == 200 and r.json()["state"] == "running" and "restore" not in view(client, job_id, CTL)
    )
    assert view(client, job_id, worker, [0, 1])["joined_at"] == r.json()["version"]
    assert view(client, job_id, worker, [0, 0])["joined_at"] == 1


def test_joined_at_after_fail_and_rejoin(client: TestClient) -> None:
    job_id, worker = new_job(client)
    for w in EVERYONE:
        assert view(client, job_id, worker, w)["joined_at"] == 1
    assert post(client, job_id, worker, "f", "fail", [[1, 0]]).json()["version"] == 2
    assert "joined_at" not in view(client, job_id, worker, [1, 0])
    assert view(client, job_id, CTL)["joined_at"] == {f"{d},{s}": 1 for d, s in EVERYONE if [d, s] != [1, 0]}
    assert post(client, job_id, worker, "r", "rejoin", [[1, 0]]).json()["version"] == 3
    assert view(client, job_id, worker, [1, 0])["joined_at"] == 3
    assert view(client, job_id, worker, [0, 0])["joined_at"] == 1
    post(client, job_id, worker, "f2", "fail", [[2, 1]])  # a later change keeps [1, 0]'s incarnation
    assert view(client, job_id, worker, [1, 0])["joined_at"] == 3


def test_a_worker_token_posts_every_kind_for_its_own_job_only(client: TestClient) -> None:
    job_id, worker = new_job(client)
    other_id, _ = new_job(client)
    assert post(client, job_id, worker, "f", "fail", [[0, 0]]).status_code == 200
    assert post(client, job_id, worker, "r", "rejoin", [[0, 0]]).status_code == 200
    assert post(client, job_id, worker, "s", "slow", [[0, 0]], factor=2.0).status_code == 200
    assert post(client, job_id, worker, "c", "checkpoint", [[0, 0]], iteration=1).status_code == 200
    for kind, kw in (("fail", {}), ("rejoin", {}), ("checkpoint", {"iteration": 1}), ("done", {})):
        r = post(client, other_id, worker, f"x-{kind}", kind, [[0, 0]], **kw)
        assert r.status_code == 403, (kind, r.text)
    assert job(client, other_id)["version"] == 1 and job(client, other_id)["checkpoints"] == {}
    assert client.patch(f"/v1/jobs/{job_id}", json={}, headers=worker).status_code == 403


def test_restore_is_persisted_across_a_restart_of_the_service(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with TestClient(create_app(settings(data))) as c:
        job_id, worker = new_job(c)
        post(c, job_id, worker, "c0", "checkpoint", [[0, 0]], iteration=3)
        post(c, job_id, worker, "c1", "checkpoint", [[1, 1]], iteration=3)
        post(c, job_id, worker, "f", "fail", [[2, 0]])
        post(c, job_id, worker, "r", "rejoin", [[2, 0]])
        post(c, job_id, worker, "lost", "fail", STAGE_1)
        post(c, job_id, worker, "f2", "fail", [[1, 0]])
        post(c, job_id, worker, "r2", "rejoin", [[1, 0]])
        manual_id, _ = new_job(c, restore_policy="manual")
        assert post(c, manual_id, CTL, "lost", "fail", STAGE_1).status_code == 409
        service = c.app.state.service  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while service._tasks and time.monotonic() < deadline:  # a refinement may still publish
            time.sleep(0.1)
        before = job(c, job_id)
        views = {tuple(w): view(c, job_id, worker, w) for w in EVERYONE}
        full = view(c, job_id, CTL)
    assert before["restore"] == {"epoch": 1, "iteration": 3} and before["version"] >= 7
    assert views[(1, 0)]["joined_at"] == 7 and views[(2, 0)]["joined_at"] == 5  # 5: the restore version
    # the crash between the needs_restore and the restore version of an auto job: the restart restores
    SQLiteStore(data).apply(manual_id, {"restore_policy": "auto"})
    with TestClient(create_app(settings(data))) as c:
        after = job(c, job_id)
        keys = (
            "state",
            "version",
            "failed",
            "restore",
            "checkpoints",
            "restorable_iteration",
            "restore_policy",
        )
        assert {k: after[k] for k in keys} == {k: before[k] for k in keys}
        assert {tuple(w): view(c, job_id, worker, w) for w in EVERYONE} == views
        assert view(c, job_id, CTL) == full
        m = job(c, manual_id)
        assert (
            m["state"] == "running" and m["restore"] == {"epoch": 1, "iteration": None} and m["version"] == 3
        )
        history = c.app.state.service.store.list_versions(manual_id)  # type: ignore[attr-defined]
        assert history[-1][3] == "restore-after-restart"


def test_after_a_restore_a_worker_that_never_polls_is_failed_after_grace_plus_timeout(tmp_path: Path) -> None:
    grace, timeout = 1.0, 0.6
    with TestClient(create_app(settings(tmp_path / "d", restore_grace_s=grace))) as c:
        r = c.post("/v1/jobs", json={"job": TINY, "heartbeat_timeout_s": timeout}, headers=CTL)
        job_id, worker = r.json()["id"], {"Authorization": f"Bearer {r.json()['worker_token']}"}
        assert post(c, job_id, CTL, "lost", "fail", STAGE_1).status_code == 200
        restored = time.monotonic()
        pollers = [w for w in EVERYONE if w != [2, 1]]  # [2, 1]'s host is gone: it never polls
        failed_at = None
        while time.monotonic() - restored < grace + timeout + 3:
            for w in pollers:
                c.get(f"/v1/jobs/{job_id}/schedule?worker={w[0]},{w[1]}", headers=worker)
            doc = job(c, job_id)
            if doc["failed"]:
                failed_at = time.monotonic() - restored
                break
            time.sleep(0.1)
        assert doc["failed"] == [[2, 1]] and doc["state"] == "running", doc
        assert failed_at is not None and grace + timeout - 0.05 <= failed_at < grace + timeout + 1.5, (
            failed_at
        )
        assert doc["restore"] == {"epoch": 1, "iteration": None}  # a later version carries the restore


def poll_without(
    c: TestClient, job_id: str, worker: dict[str, str], silent: list[int], within_s: float
) -> dict[str, Any]:
    """Every worker but `silent` polls until the job names a failed worker or `within_s` passed; the
    job's status then."""
    deadline = time.monotonic() + within_s
    doc = job(c, job_id)
    while time.monotonic() < deadline and not doc["failed"]:
        for w in EVERYONE:
            if w != silent:
                c.get(f"/v1/jobs/{job_id}/schedule?worker={w[0]},{w[1]}", headers=worker)
        time.sleep(0.1)
        doc = job(c, job_id)
    return doc


def test_a_job_none_of_whose_workers_comes_back_after_a_restore_is_restored_once(tmp_path: Path) -> None:
    """Before: every worker silent after the restore was declared failed at grace + timeout, which
    lost the stages again and restored again, every ~90 s forever. Now the job waits at the restore
    version until a worker polls; then the ones still silent are failed as before."""
    grace, timeout = 0.5, 1.0  # a timeout well above a round of polls under CI load
    with TestClient(create_app(settings(tmp_path / "d", restore_grace_s=grace))) as c:
        r = c.post("/v1/jobs", json={"job": TINY, "heartbeat_timeout_s": timeout}, headers=CTL)
        job_id, worker = r.json()["id"], {"Authorization": f"Bearer {r.json()['worker_token']}"}
        for w in EVERYONE:  # every worker polls once: all of them are tracked
            c.get(f"/v1/jobs/{job_id}/schedule?worker={w[0]},{w[1]}", headers=worker)
        assert post(c, job_id, CTL, "lost", "fail", STAGE_1).status_code == 200
        restored = job(c, job_id)
        assert restored["restore"] == {"epoch": 1, "iteration": None}
        time.sleep(2 * (grace + timeout))  # nobody polls: several heartbeat timeouts pass
        doc = job(c, job_id)
        assert (doc["version"], doc["state"], doc["failed"]) == (restored["version"], "running", []), doc
        assert doc["restore"]["epoch"] == 1
        doc = poll_without(c, job_id, worker, [2, 1], timeout + 3)  # the restart comes back without it
        assert doc["failed"] == [[2, 1]] and doc["state"] == "running", doc


def test_a_worker_that_died_while_the_service_was_down_is_failed_once_its_peers_poll(tmp_path: Path) -> None:
    """Before: after a restart every worker was untracked until its first poll, so a worker that died
    while the service was down was never declared failed and its peers waited on it forever."""
    grace, timeout = 0.5, 1.0  # a timeout well above a round of polls under CI load
    data = tmp_path / "d"
    with TestClient(create_app(settings(data, restore_grace_s=grace))) as c:
        r = c.post("/v1/jobs", json={"job": TINY, "heartbeat_timeout_s": timeout}, headers=CTL)
        job_id, worker = r.json()["id"], {"Authorization": f"Bearer {r.json()['worker_token']}"}
        for w in EVERYONE:
            c.get(f"/v1/jobs/{job_id}/schedule?worker={w[0]},{w[1]}", headers=worker)
    with TestClient(create_app(settings(data, restore_grace_s=grace))) as c:
        time.sleep(2 * (grace + timeout))  # nobody polls: nobody is failed (the job waits for them)
        assert job(c, job_id)["failed"] == []
        doc = poll_without(c, job_id, worker, [1, 0], grace + timeout + 3)  # died while it was down
        assert doc["failed"] == [[1, 0]] and doc["state"] == "running", doc


def test_a_crash_between_the_two_versions_of_a_restore_applies_the_event_once(tmp_path: Path) -> None:
    """The event was written with the restore version only: after a crash between the two versions
    the restart finished the restore, and the client's retry of the same event failed the restored
    stage again and restored a second time."""
    data = tmp_path / "d"
    with TestClient(create_app(settings(data)), raise_server_exceptions=True) as c:
        job_id, worker = new_job(c)
        store = c.app.state.service.store  # type: ignore[attr-defined]
        real = store.apply

        def crash_after_needs_restore(job: str, update: Any, version: Any = None, event: Any = None) -> None:
            real(job, update, version=version, event=event)
            if version is not None and version.source == "needs_restore":
                raise RuntimeError("the process died here")

        store.apply = crash_after_needs_restore
        with pytest.raises(RuntimeError, match="died here"):
            post(c, job_id, worker, "lose", "fail", STAGE_1)
    with TestClient(create_app(settings(data))) as c:
        restored = job(c, job_id)  # the restart finished the restore
        assert restored["restore"]["epoch"] == 1 and restored["failed"] == [], restored
        r = post(c, job_id, worker, "lose", "fail", STAGE_1)  # the client's retry
        assert r.status_code == 200 and r.json()["replayed"] is True, r.text
        after = job(c, job_id)
        assert (after["version"], after["failed"], after["restore"]) == (
            restored["version"],
            [],
            restored["restore"],
        ), after
