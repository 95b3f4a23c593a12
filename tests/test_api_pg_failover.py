"""Replicas dying under load-balanced traffic (real `recycle serve --database` processes on a real
PostgreSQL, bench/pg_cluster.py): a worker that polled only a replica killed -9 is failed by another
replica once it goes silent (once, and its `heartbeats` row pruned), a replica stopped for longer
than the heartbeat timeout gets no worker that polls it failed (by another replica or by itself), an
auto restore cut by a kill between its two versions completes on the client's retry elsewhere, the
same event or Idempotency-Key sent to two replicas at once is applied once, a NUL character is a 4xx
on PostgreSQL too, and a server that hangs (SIGSTOP) is 503 within the database timeout while polls
keep being answered from memory."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.jobs import service_job_doc
from tests.pg_replica import CTL, Replica, create_job, event

psycopg = pytest.importorskip("psycopg")
pytestmark = pytest.mark.timeout(120)

JOB: dict[str, Any] = service_job_doc(3, 2, 2)  # 3 pipelines x 2 stages
DB = "failover"


@pytest.fixture(scope="module")
def steady(pg_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    """The replica that survives (the others are started per test and killed)."""
    replica = Replica(pg_server.create_database(DB), tmp_path_factory.mktemp("failover") / "steady.log")
    try:
        yield replica
    finally:
        replica.stop()


def _query(pg_server: Any, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(pg_server.url_for(DB)) as conn:
        return list(conn.execute(sql, args).fetchall())


def _heartbeat_failures(pg_server: Any, job_id: str) -> int:
    """How many heartbeat `fail` events the job's history holds."""
    sql = "SELECT count(*) FROM events WHERE job_id = %s AND event_id LIKE 'heartbeat-%%'"
    return int(_query(pg_server, sql, job_id)[0][0])


def _status(base: str, job_id: str) -> dict[str, Any]:
    r = httpx.get(f"{base}/v1/jobs/{job_id}", headers=CTL, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _kill(victim: Replica) -> None:
    victim.proc.kill()
    assert victim.proc.wait(timeout=10) == -9


def test_a_silent_worker_whose_replica_was_killed_is_failed_by_another_replica_once(
    steady: Replica, pg_server: Any, tmp_path: Path
) -> None:
    victim = Replica(pg_server.url_for(DB), tmp_path / "victim.log")
    try:
        job_id, worker = create_job(victim.base, JOB, heartbeat_enabled=True, heartbeat_timeout_s=2.0)
        for _ in range(4):  # worker [1, 0] polls the victim only; the others never poll (untracked)
            url = f"{victim.base}/v1/jobs/{job_id}/schedule?worker=1,0&after_version=1&wait=0"
            assert httpx.get(url, headers=worker, timeout=10).status_code == 304
            last_poll = time.monotonic()
            time.sleep(0.3)
        time.sleep(1.2)  # the victim's heartbeat check published the arrival (every 1 s)
        _kill(victim)
        killed = time.monotonic()
    finally:
        victim.stop()
    # The steady replica counts the victim live for 3 of its checks (3 s) after its last write, and
    # judges silence as of that write until then; then a check interval and slack for a loaded machine.
    deadline = max(last_poll + 2.0, killed + 3.0) + 3.0
    while _status(steady.base, job_id)["failed"] != [[1, 0]]:
        assert time.monotonic() < deadline, "no replica failed the silent worker of the dead replica"
        time.sleep(0.1)
    print(f"failed {time.monotonic() - last_poll:.2f} s after its last poll (timeout 2 s)")
    time.sleep(1.1)  # another check (every 1 s): nobody fails it again
    assert _heartbeat_failures(pg_server, job_id) == 1
    assert _query(pg_server, "SELECT d, s FROM heartbeats WHERE job_id = %s", job_id) == []  # pruned
    url = f"{steady.base}/v1/jobs/{job_id}/schedule?worker=0,0&after_version=2&wait=0"
    assert httpx.get(url, headers=worker, timeout=10).status_code == 304  # [0, 0] polls the survivor
    alive = [[d, s] for d in range(3) for s in range(2) if [d, s] != [1, 0]]
    done = event(steady.base, job_id, "all-done", "done", alive)
    assert done.status_code == 200 and done.json()["state"] == "finished", done.text
    assert _query(pg_server, "SELECT count(*) FROM heartbeats WHERE job_id = %s", job_id) == [(0,)]


def test_a_replica_stopped_longer_than_the_timeout_gets_no_worker_that_polls_it_failed(
    steady: Replica, pg_server: Any, tmp_path: Path
) -> None:
    """Worker [0, 1] polls only `paused` (every 0.3 s), which is stopped (SIGSTOP) for 2.5 s, longer
    than the job's 2 s timeout but within its three checks of 2 s. The steady replica must judge the
    worker's silence as of paused's last publication, not as of now, and paused, woken, must read the
    polls that waited before judging anyone (before, one of them failed the worker). Once the worker
    goes silent it is failed, once."""
    paused = Replica(pg_server.url_for(DB), tmp_path / "paused.log", RECYCLE_HEARTBEAT_CHECK_S="2")
    try:
        job_id, worker = create_job(paused.base, JOB, heartbeat_enabled=True, heartbeat_timeout_s=2.0)
        url = f"{paused.base}/v1/jobs/{job_id}/schedule?worker=0,1&after_version=1&wait=0"
        stop = threading.Timer(2.5, _pause, args=(paused, 2.5))
        stop.start()
        try:
            until = time.monotonic() + 9.0
            while time.monotonic() < until:
                assert httpx.get(url, headers=worker, timeout=10).status_code == 304, "the worker was failed"
                last_poll = time.monotonic()
                time.sleep(0.3)
        finally:
            stop.join()
        assert _status(steady.base, job_id)["failed"] == []
        deadline = last_poll + 2.0 + 2.0 + 3.0  # the timeout, paused's check and slack
        while _status(steady.base, job_id)["failed"] != [[0, 1]]:
            assert time.monotonic() < deadline, "the silent worker was never failed"
            time.sleep(0.1)
        time.sleep(2.1)  # both replicas have checked again: nobody fails it twice
        assert _heartbeat_failures(pg_server, job_id) == 1
    finally:
        paused.stop()


def _pause(replica: Replica, seconds: float) -> None:
    """Stop `replica`'s process for `seconds` (SIGSTOP, then SIGCONT)."""
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)


def test_precompute_started_on_a_replica_killed_mid_plan_is_finished_by_another(
    steady: Replica, pg_server: Any, tmp_path: Path
) -> None:
    """The victim claims keys (advisory locks on its session) and dies holding one: the survivor, which
    shares the job's precompute, takes its keys over and finishes."""
    victim = Replica(pg_server.url_for(DB), tmp_path / "victim.log", RECYCLE_PRECOMPUTE_TIME_LIMIT_S="2")
    try:
        job_id, _ = create_job(victim.base, service_job_doc(2, 3, 2))  # keys no other test planned
        claims = (
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.locktype = 'advisory' AND a.application_name = %s"
        )
        name = f"recycle-{victim.proc.pid}"
        deadline = time.monotonic() + 10
        while _query(pg_server, claims, name) == [(0,)]:  # wait until the victim plans a key
            assert time.monotonic() < deadline, "the victim never claimed a key"
            time.sleep(0.02)
        _kill(victim)
    finally:
        victim.stop()
    assert _query(pg_server, claims, name) == [(0,)]  # its claims went with its session
    deadline = time.monotonic() + 30
    while (pre := _status(steady.base, job_id)["precompute"])["done"] < pre["total"] or not pre["total"]:
        assert time.monotonic() < deadline, f"precompute stuck at {pre} after the kill"
        time.sleep(0.2)
    print(f"precompute {pre} finished by the survivor")


def test_an_auto_restore_cut_by_a_replica_kill_completes_on_the_retry_elsewhere(
    steady: Replica, pg_server: Any, tmp_path: Path
) -> None:
    job_id, _ = create_job(steady.base, JOB)  # restore_policy auto (the default)
    victim = Replica(
        pg_server.url_for(DB),
        tmp_path / "victim.log",
        RECYCLE_TEST_KILL_IN_APPLY="after_commit:lose-stage-1",  # the event goes with needs_restore
    )
    stage_1 = [[d, 1] for d in range(3)]
    try:
        with pytest.raises(httpx.TransportError):  # dies between needs_restore and the restore version
            event(victim.base, job_id, "lose-stage-1", "fail", stage_1)
        assert victim.proc.wait(timeout=10) == -9
    finally:
        victim.stop()
    versions = "SELECT version, source, cause FROM versions WHERE job_id = %s ORDER BY version"
    assert [v[0::2] for v in _query(pg_server, versions, job_id)] == [(1, None), (2, "lose-stage-1")]
    deadline = time.monotonic() + 5
    while _status(steady.base, job_id)["state"] != "needs_restore":
        assert time.monotonic() < deadline, "the survivor never saw the needs_restore version"
        time.sleep(0.05)
    r = event(steady.base, job_id, "lose-stage-1", "fail", stage_1)  # the client's retry: applied once
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["version"], body["state"], body["failed"], body["replayed"]) == (3, "running", [], True)
    assert body["restore"]["epoch"] == 1 and body["needs_restore_version"] == 2
    assert [v[0] for v in _query(pg_server, versions, job_id)] == [1, 2, 3]
    again = event(steady.base, job_id, "lose-stage-1", "fail", stage_1)
    assert again.json()["replayed"] is True and again.json()["version"] == 3


def _both(fn: Any, *args: Any) -> list[httpx.Response]:
    """fn(arg) for each arg in threads started together; the answers in args' order."""
    out: dict[int, httpx.Response] = {}
    threads = [
        threading.Thread(target=lambda i=i, a=a: out.__setitem__(i, fn(a))) for i, a in enumerate(args)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return [out[i] for i in range(len(args))]


def test_the_same_event_or_idempotency_key_on_two_replicas_at_once_is_applied_once(
    steady: Replica, pg_server: Any, tmp_path: Path
) -> None:
    other = Replica(pg_server.url_for(DB), tmp_path / "other.log")
    try:
        job_id, _ = create_job(steady.base, JOB)
        for i in range(2):
            answers = _both(
                lambda base, i=i: event(base, job_id, f"same-{i}", "slow", [[i, 0]]), steady.base, other.base
            )
            assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
            first, second = (a.json() for a in answers)
            assert {first["replayed"], second["replayed"]} == {False, True}
            assert {k: v for k, v in first.items() if k != "replayed"} == {
                k: v for k, v in second.items() if k != "replayed"
            }
        stored = _query(pg_server, "SELECT version FROM versions WHERE job_id = %s", job_id)
        assert sorted(v for (v,) in stored) == [1, 2, 3]

        def post(base: str) -> httpx.Response:
            headers = {**CTL, "Idempotency-Key": "review-key-0123456789"}
            for _ in range(20):  # a 503 (the other replica registered the key first) says: retry
                r = httpx.post(f"{base}/v1/jobs", json={"job": JOB}, headers=headers, timeout=30)
                if r.status_code != 503:
                    return r
                time.sleep(0.1)
            return r

        created = _both(post, steady.base, other.base)
        assert [c.status_code for c in created] == [201, 201], [c.text for c in created]
        assert created[0].json()["id"] == created[1].json()["id"]
        assert created[0].json()["worker_token"] == created[1].json()["worker_token"]
        names = _query(pg_server, "SELECT count(*) FROM jobs WHERE id = %s", created[0].json()["id"])
        assert names == [(1,)]
        token = {"Authorization": f"Bearer {created[0].json()['worker_token']}"}
        for base in (steady.base, other.base):  # the worker token works on both replicas at once
            url = f"{base}/v1/jobs/{created[0].json()['id']}/schedule?worker=0,0"
            assert httpx.get(url, headers=token, timeout=10).status_code == 200
    finally:
        other.stop()


def test_a_nul_character_is_a_4xx_naming_the_field_on_postgresql(steady: Replica) -> None:
    assert httpx.get(f"{steady.base}/v1/jobs/a%00b", headers=CTL, timeout=10).status_code == 404
    job_id, _ = create_job(steady.base, JOB)
    r = event(steady.base, job_id, "nul\x00id", "fail", [[0, 0]])
    assert r.status_code == 422 and "event_id" in r.json()["detail"], r.text
    named = {**JOB, "name": "a\x00b"}
    r = httpx.post(f"{steady.base}/v1/jobs", json={"job": named}, headers=CTL, timeout=30)
    assert r.status_code == 422 and "job.name" in r.json()["detail"], r.text
    assert _status(steady.base, job_id)["version"] == 1  # nothing half applied


def _server_pids(pg_server: Any) -> list[int]:
    """The test server's postmaster and its children (this session started them)."""
    main = int((pg_server.data / "postmaster.pid").read_text().split()[0])
    pids = [main]
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == main
            ):
                pids.append(int(entry.name))
    return pids


def test_a_hung_server_is_503_within_seconds_and_never_stalls_the_polls(
    steady: Replica, pg_server: Any
) -> None:
    """PostgreSQL stops answering without closing its sockets (SIGSTOP): libpq would wait forever on
    the event loop; the watchdog (api/store_pg_watch.py) cuts the calls, so polls from memory keep
    answering in well under a second, events answer 503 within the database timeout (3 s)."""
    job_id, worker = create_job(steady.base, JOB)
    pids = _server_pids(pg_server)
    worst, worst_at, answers = 0.0, 0.0, []
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:

        def post() -> None:
            r = event(steady.base, job_id, "hung", "slow", [[0, 1]])
            answers.append((r, time.monotonic()))

        posted = threading.Thread(target=post)
        t0 = time.monotonic()
        posted.start()
        with httpx.Client(timeout=10) as client:
            while time.monotonic() - t0 < 4.5:
                t = time.monotonic()
                r = client.get(f"{steady.base}/v1/jobs/{job_id}/schedule?worker=0,0", headers=worker)
                assert r.status_code == 200 and r.json()["version"] == 1
                if time.monotonic() - t > worst:
                    worst, worst_at = time.monotonic() - t, t - t0
                time.sleep(0.02)
        posted.join(timeout=10)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    print(f"worst poll {worst:.3f} s; event answered after {answers[0][1] - t0:.2f} s")
    assert worst < 2.0, (
        f"a poll waited {worst:.2f} s from {worst_at:.2f} s on:\n{steady.log.read_text()[-3000:]}"
    )
    (r, done), *_ = answers
    assert r.status_code == 503 and r.json()["error"] == "database_unavailable" and done - t0 < 4.5
    assert r.headers["retry-after"] == "1"
    deadline = time.monotonic() + 20
    while (r := event(steady.base, job_id, "after-hang", "slow", [[0, 1]])).status_code != 200:
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.json()["version"] == 2


def test_published_arrivals_are_forgotten_with_the_worker() -> None:
    """SharedHeartbeats keeps what it published only for workers still tracked in memory: a failed
    or finished worker (dropped from last_seen) or a job gone leaves no entry behind."""
    from types import SimpleNamespace

    from api.job_sync import SharedHeartbeats

    tracked = SimpleNamespace(last_seen={(0, 0): 1.0})
    service = SimpleNamespace(jobs={"a": tracked})
    beats = SharedHeartbeats(service)  # type: ignore[arg-type]
    beats._published.update({("a", (0, 0)): 1.0, ("a", (1, 0)): 2.0, ("gone", (0, 0)): 3.0})
    beats._prune()
    assert beats._published == {("a", (0, 0)): 1.0}
