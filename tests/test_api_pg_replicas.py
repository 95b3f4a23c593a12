"""Two real `recycle serve --database` replicas on one real PostgreSQL server (bench/pg_cluster.py):
an event on one wakes a long-poll on the other, a replica killed in the middle of applying an event
loses nothing and applies nothing twice, and a PostgreSQL restart is 503 meanwhile, then recovers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.jobs import service_job_doc
from tests.pg_replica import CTL, Replica, create_job, event

pytest.importorskip("psycopg")
pytestmark = pytest.mark.timeout(180)

JOB: dict[str, Any] = service_job_doc(3, 2, 2)


@pytest.fixture(scope="module")
def replicas(pg_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, Replica]]:
    url = pg_server.create_database("replicas")
    logs = tmp_path_factory.mktemp("replicas")
    a = Replica(url, logs / "a.log", wait=False)
    b = Replica(url, logs / "b.log", wait=False)  # both start at once
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b
    finally:
        for replica in (a, b):
            if replica.proc.poll() is None:
                replica.proc.terminate()  # both stop at once
        a.stop()
        b.stop()


def _status(base: str, job_id: str) -> dict[str, Any]:
    r = httpx.get(f"{base}/v1/jobs/{job_id}", headers=CTL, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _versions(pg_server: Any, job_id: str) -> list[int]:
    import psycopg

    with psycopg.connect(pg_server.url_for("replicas")) as conn:
        rows = conn.execute("SELECT version FROM versions WHERE job_id = %s ORDER BY version", (job_id,))
        return [int(r[0]) for r in rows]


def test_an_event_on_replica_a_wakes_a_long_poll_on_replica_b(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    job_id, worker = create_job(a.base, JOB)
    assert _status(b.base, job_id)["version"] == 1  # B reads the job A registered
    answers: list[tuple[float, httpx.Response]] = []

    def poll() -> None:
        url = f"{b.base}/v1/jobs/{job_id}/schedule?worker=0,0&after_version=1&wait=20"
        r = httpx.get(url, headers=worker, timeout=30)
        answers.append((time.monotonic(), r))

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)  # parked on B
    assert not answers
    r = event(a.base, job_id, "fail-1", "fail", [[1, 1]])
    committed = time.monotonic()
    assert r.status_code == 200, r.text
    poller.join(timeout=10)
    (arrived, answer), *_ = answers
    assert answer.status_code == 200 and answer.json()["version"] == r.json()["version"] == 2
    assert answer.json()["failed"] == [[1, 1]]
    assert arrived - committed < 1.0, f"B's poller woke {arrived - committed:.3f} s after A committed"
    # and the other way round: B's change is seen by A (job state, not only polls)
    assert event(b.base, job_id, "rejoin-1", "rejoin", [[1, 1]]).json()["version"] == 3
    deadline = time.monotonic() + 2
    while _status(a.base, job_id)["version"] != 3:
        assert time.monotonic() < deadline, "A never saw B's version 3"
        time.sleep(0.05)
    for replica in (a, b):  # each replica's own prometheus_client registry
        metrics = httpx.get(f"{replica.base}/metrics", timeout=10)
        assert metrics.status_code == 200 and "recycle_schedule_versions_total" in metrics.text
    # the same event_id on the other replica is a replay, not a second application
    again = event(a.base, job_id, "fail-1", "fail", [[1, 1]])
    assert again.status_code == 200 and again.json()["replayed"] is True and again.json()["version"] == 2


def test_concurrent_events_on_both_replicas_get_consecutive_versions(
    replicas: tuple[Replica, Replica], pg_server: Any
) -> None:
    a, b = replicas
    job_id, _ = create_job(a.base, JOB)
    results: list[httpx.Response] = []

    def send(base: str, i: int) -> None:
        results.append(event(base, job_id, f"slow-{i}", "slow", [[i % 3, i % 2]]))

    threads = [threading.Thread(target=send, args=(a.base if i % 2 else b.base, i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    versions = sorted(r.json()["version"] for r in results if r.json()["changed"])
    assert len(versions) == len(set(versions))  # no version given out twice
    assert _versions(pg_server, job_id) == list(range(1, max([1, *versions]) + 1))


@pytest.mark.parametrize("point", ["before_commit", "after_commit"])
def test_a_replica_killed_while_applying_an_event_loses_nothing_and_applies_nothing_twice(
    replicas: tuple[Replica, Replica], pg_server: Any, tmp_path: Path, point: str
) -> None:
    a, b = replicas
    job_id, _ = create_job(a.base, JOB)
    victim = Replica(
        pg_server.url_for("replicas"), tmp_path / "victim.log", RECYCLE_TEST_KILL_IN_APPLY=f"{point}:kill-me"
    )
    try:
        with pytest.raises(httpx.TransportError):  # it dies with the event half applied
            event(victim.base, job_id, "kill-me", "fail", [[2, 0]])
        assert victim.proc.wait(timeout=10) == -9
    finally:
        victim.stop()
    expected = [1] if point == "before_commit" else [1, 2]
    assert _versions(pg_server, job_id) == expected  # rolled back, or committed once
    r = event(b.base, job_id, "kill-me", "fail", [[2, 0]])  # the client's retry, on another replica
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 2 and r.json()["replayed"] is (point == "after_commit")
    assert _versions(pg_server, job_id) == [1, 2]
    nxt = event(a.base, job_id, "after-kill", "rejoin", [[2, 0]])  # the victim's job lock is free
    assert nxt.status_code == 200 and nxt.json()["version"] == 3
    assert _versions(pg_server, job_id) == [1, 2, 3]
    assert _status(a.base, job_id)["version"] == _status(b.base, job_id)["version"] == 3


def test_postgresql_restart_is_503_meanwhile_and_recovers_by_itself(
    replicas: tuple[Replica, Replica], pg_server: Any
) -> None:
    a, b = replicas
    job_id, worker = create_job(a.base, JOB)
    deadline = time.monotonic() + 5  # B learns of the job and its first version (NOTIFY) before the outage
    url = f"{b.base}/v1/jobs/{job_id}/schedule?worker=0,0"
    while httpx.get(url, headers=worker, timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "replica B never served the job's first version"
        time.sleep(0.05)
    pg_server.stop()
    try:
        statuses = set()
        deadline = time.monotonic() + 6
        i = 0
        while time.monotonic() < deadline:
            i += 1
            r = event(a.base if i % 2 else b.base, job_id, f"outage-{i}", "slow", [[0, 1]])
            statuses.add(r.status_code)
            if r.status_code == 503:
                assert r.json()["error"] == "database_unavailable"
                if i > 4:
                    break
        assert statuses == {503}, statuses
        created = httpx.post(f"{a.base}/v1/jobs", json={"job": JOB}, headers=CTL, timeout=30)
        assert created.status_code == 503
        poll = httpx.get(f"{b.base}/v1/jobs/{job_id}/schedule?worker=0,0", headers=worker, timeout=10)
        assert poll.status_code == 200 and poll.json()["version"] == 1  # served from memory meanwhile
    finally:
        pg_server.start()
    deadline = time.monotonic() + 20
    while True:
        r = event(a.base, job_id, "after-outage", "fail", [[0, 1]])
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text
        assert time.monotonic() < deadline, "the service did not recover within 20 s of PostgreSQL's restart"
        time.sleep(0.2)
    assert r.json()["version"] == 2
    deadline = time.monotonic() + 5
    while _status(b.base, job_id)["version"] != 2:
        assert time.monotonic() < deadline, "B did not follow after the restart"
        time.sleep(0.1)
    assert event(b.base, job_id, "after-outage-b", "rejoin", [[0, 1]]).json()["version"] == 3


def test_a_worker_polling_another_replica_is_not_failed_and_a_silent_one_is_failed_once(
    replicas: tuple[Replica, Replica], pg_server: Any
) -> None:
    """Worker [0, 0] polls B once, then only A: B (which tracks it too) must not fail it, since A saw
    it. Once it goes silent, both replicas find it silent, and it is failed exactly once."""
    a, b = replicas
    job_id, worker = create_job(a.base, JOB, heartbeat_enabled=True, heartbeat_timeout_s=2.0)

    def beat(base: str) -> None:
        url = f"{base}/v1/jobs/{job_id}/schedule?worker=0,0&after_version=1&wait=0"
        assert httpx.get(url, headers=worker, timeout=10).status_code == 304

    beat(b.base)
    until = time.monotonic() + 4.0  # twice the timeout
    while time.monotonic() < until:
        beat(a.base)
        time.sleep(0.3)
    assert _status(b.base, job_id)["failed"] == [] and _versions(pg_server, job_id) == [1]
    deadline = time.monotonic() + 10
    while _status(a.base, job_id)["failed"] != [[0, 0]]:
        assert time.monotonic() < deadline, "the silent worker was never failed"
        time.sleep(0.2)
    time.sleep(2.5)  # the other replica's check has run by now
    assert _versions(pg_server, job_id) == [1, 2]
    import psycopg

    with psycopg.connect(pg_server.url_for("replicas")) as conn:
        beats = conn.execute(
            "SELECT count(*) FROM events WHERE job_id = %s AND event_id LIKE 'heartbeat-%%'", (job_id,)
        ).fetchone()
    assert beats is not None and beats[0] == 1
