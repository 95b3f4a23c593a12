"""Workers and launcher against the real planner service (uvicorn on 127.0.0.1, data dir in tmp).

The launcher is the job's controller (ServicePublisher: registration, fail / rejoin events, following
the job's versions for restores); the workers long-poll their schedule over HTTP (HttpScheduleSource)
and post `done` when they completed, so the job ends `finished` with its heartbeat still on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest

from planner.contract import JobSpec
from runtime_adapter.assignment import Worker
from runtime_adapter.client import HttpScheduleSource, ScheduleClient, SourceRejected
from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.publishers import RegistrationRefused, ServicePublisher
from tests.jobs import tiny_job
from tests.test_api_live import TOKEN, free_port, server
from tests.test_runtime_process import (
    CFG,
    assert_exactly_once,
    assert_matches_reference,
    assert_peers_identical,
    records,
)

SERVICE_ENV = {"RECYCLE_HEARTBEAT_CHECK_S": "0.2"}


def steps(out: Path, workers: list[Worker], version: int = 0) -> int:
    """The fewest step records (of schedule version >= `version`) any of `workers` has written."""
    return min(
        sum(1 for r in records(out, w) if r["event"] == "step" and r["version"] >= version) for w in workers
    )


def supervise_until(launcher: Launcher, done: Callable[[], bool], what: str, timeout_s: float = 90) -> None:
    """Run the launcher's supervision (poll) until `done()`; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        launcher.poll()
        if time.monotonic() > deadline:
            launcher.terminate()
            pytest.fail(f"timed out waiting for: {what}")
        time.sleep(0.02)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, and SIGKILL if the service is not gone in 3 s (a solve in its pools can hold it)."""
    proc.terminate()
    try:
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    with server(tmp_path_factory.mktemp("service"), port, **SERVICE_ENV) as proc:
        yield f"http://127.0.0.1:{port}"
        stop(proc)


@pytest.mark.timeout(60)
def test_a_refused_registration_is_one_readable_line(service: str) -> None:
    job = tiny_job(2, 2)
    with pytest.raises(
        RegistrationRefused, match=r"refused the job \(HTTP 401: missing or invalid bearer token\)"
    ):
        ServicePublisher(service, "wrong-token", job, 1).start()
    with pytest.raises(RegistrationRefused, match=r"HTTP 422: max_failures: 99 is above the limit"):
        ServicePublisher(service, TOKEN, job, 99).start()  # launch turns it into exit 2


@pytest.mark.timeout(60)
def test_client_answers_304_needs_restore_and_stops_on_401_403_404(service: str) -> None:
    job = tiny_job(2, 2)
    pub = ServicePublisher(
        service, TOKEN, job, max_failures=0, heartbeat_enabled=False, restore_policy="manual"
    )
    pub.start()
    assert pub.job_id is not None and pub.worker_token is not None
    ok = HttpScheduleSource(service, pub.job_id, pub.worker_token, (0, 1), 2, 2, 4)
    a = ok.fetch(0, timedelta(seconds=1))
    assert a is not None and a.version == 1 and a.state == "running" and a.stage_alive == ((0, 1), (1, 1))
    t0 = time.monotonic()
    assert ok.fetch(1, timedelta(seconds=0.3)) is None  # 304 after the wait
    assert time.monotonic() - t0 >= 0.25
    assert pub.report("fail", [(0, 1)]).version == 2
    assert pub.report("fail", [(1, 1)]).lost_stages == [1]  # 409: the job needs a restore
    a = ok.fetch(2, timedelta(seconds=1))
    assert a is not None and a.version == 3 and a.state == "needs_restore"
    assert pub.report("rejoin", [(0, 1), (1, 1)]).version == 4  # manual policy: rejoins restore it
    a = ok.fetch(3, timedelta(seconds=1))
    assert a is not None and a.state == "running" and a.alive and not a.failed
    pub.base = f"http://127.0.0.1:{free_port()}"  # the service is unreachable: events wait in the outbox
    assert pub.report("fail", [(0, 1)]).version is None
    assert pub.report("fail", [(1, 1)]).version is None and len(pub.outbox) == 2
    assert pub.flush() == [] and len(pub.outbox) == 2
    pub.base = service
    time.sleep(max(0.0, pub.retry_at - time.monotonic()))  # the outbox waits its jittered backoff
    assert pub.flush() == [1] and not pub.outbox  # delivered in order; the second one answered 409
    assert pub.report("rejoin", [(0, 1), (1, 1)]).version == 7 and pub.status()["state"] == "running"
    assert pub.latest_restore() is None  # manual: no restore version was published
    other = ServicePublisher(service, TOKEN, job, max_failures=0, heartbeat_enabled=False)
    other.start()
    assert other.worker_token is not None
    cases = {
        "401": HttpScheduleSource(service, pub.job_id, "wrong-token", (0, 0), 2, 2, 4),
        "403": HttpScheduleSource(service, pub.job_id, other.worker_token, (0, 0), 2, 2, 4),
        "404": HttpScheduleSource(service, "no-such-job", TOKEN, (0, 0), 2, 2, 4),
    }
    for code, source in cases.items():
        client = ScheduleClient(source).start()
        t0 = time.monotonic()
        with pytest.raises(SourceRejected, match=code):
            client.wait_newer(0, timedelta(seconds=20))
        assert time.monotonic() - t0 < 5, f"HTTP {code} was retried"


@pytest.mark.timeout(200)
def heartbeat_launch(
    service: str, job: JobSpec, n: int, victim: Worker, out: Path, timeout_s: float
) -> tuple[ServicePublisher, Launcher, list[Worker]]:
    """A launch that leaves failure detection to the service's heartbeat (timeout `timeout_s`), once
    every worker stepped 3 times; (publisher, launcher, the workers other than `victim`)."""
    pub = ServicePublisher(service, TOKEN, job, max_failures=1, heartbeat_timeout_s=timeout_s)
    spec = LaunchSpec(job, asdict(CFG), n, out, pace_ms=50)
    launcher = Launcher(spec, publisher=pub, report_failures=False)
    launcher.start()
    everyone = spec.workers()
    supervise_until(launcher, lambda: steps(out, everyone) >= 3, "3 steps")
    return pub, launcher, [w for w in everyone if w != victim]


def test_heartbeat_timeout_fails_a_killed_worker(
    service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher does not report the death: the service's heartbeat timeout fails the worker and
    the survivors get the re-routed schedule over HTTP. The survivors then post `done`: the job is
    finished, with its heartbeat still on, and their silence is never taken for a failure."""
    job, n, victim = tiny_job(2, 2), 24, (1, 1)
    # Workers ask for the default 30 s wait; the service grants a third of the heartbeat timeout and
    # counts only polls arriving, so detection takes the heartbeat timeout, not the poll wait.
    monkeypatch.setenv("RECYCLE_POLL_WAIT_S", "30")
    timeout_s = 1.5
    pub, launcher, survivors = heartbeat_launch(service, job, n, victim, tmp_path, timeout_s)
    launcher.kill(victim)
    killed = time.monotonic()
    supervise_until(launcher, lambda: bool(pub.status()["failed"]), "the heartbeat failure", 40)
    assert time.monotonic() - killed < 15, "detected only after the poll's 30 s wait"
    doc = pub.status()
    assert doc["failed"] == [list(victim)] and doc["state"] == "running"
    codes = launcher.wait(timedelta(seconds=150))
    assert all(codes[w] == 0 for w in survivors), codes
    time.sleep(timeout_s + 1.0)  # the survivors stopped polling a timeout ago: not failures
    end = pub.status()
    assert end["state"] == "finished" and end["heartbeat_enabled"] is True, end
    assert end["failed"] == [list(victim)] and end["done"] == [list(w) for w in survivors], end
    versions = {r["version"] for w in survivors for r in records(tmp_path, w) if r["event"] == "step"}
    assert doc["version"] in versions or max(versions) > doc["version"], versions
    assert_exactly_once(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, survivors)


@pytest.mark.timeout(200)
def test_a_hung_worker_the_service_failed_is_ended_and_the_launch_finishes(
    service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped with SIGSTOP (alive, silent): the service's heartbeat fails it, the survivors
    train on, and the launcher ends the stopped process and starts a re-joiner in its place (as for a
    worker that finds itself failed). Before, its process kept `settled()` false and the launch never
    ended; then it was ended but counted dead, so that a partitioned worker whose launcher saw
    its failure first never re-joined."""
    job, n, victim = tiny_job(2, 2), 24, (1, 1)
    monkeypatch.setenv("RECYCLE_POLL_WAIT_S", "30")
    pub, launcher, survivors = heartbeat_launch(service, job, n, victim, tmp_path, 1.5)
    stopped = launcher.procs[victim].pid
    os.kill(stopped, signal.SIGSTOP)
    codes = launcher.wait(timedelta(seconds=150))
    assert all(code == 0 for code in codes.values()), codes
    assert launcher.procs[victim].pid != stopped and launcher.rejoins[victim] == 1
    end = pub.status()
    assert end["state"] == "finished" and end["failed"] == [], end
    assert [r for r in records(tmp_path, victim) if r["event"] == "rejoin"], "no re-join"
    assert_exactly_once(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, [*survivors, victim])


@pytest.mark.timeout(200)
def test_whole_stage_lost_under_the_service_is_restored_by_the_service(service: str, tmp_path: Path) -> None:
    """Both stage-1 workers die in iteration 5 (checkpoints every 2): the launcher posts both fails,
    the service (restore policy auto) commits needs_restore and at once a restore version, and the
    launcher follows it: it restarts the two dead workers with --resume-at/--restore-epoch (the
    stage-0 survivors load in place). It posts no rejoin. Final parameters equal failure-free
    training."""
    job, n = tiny_job(2, 2), 8
    pub = ServicePublisher(
        service, TOKEN, job, max_failures=1, heartbeat_enabled=False, restore_policy="auto"
    )
    fail_at = {(0, 1): (5, "F"), (1, 1): (5, "F")}
    spec = LaunchSpec(job, asdict(CFG), n, tmp_path, fail_at=fail_at, checkpoint_every=2)
    launcher = Launcher(spec, publisher=pub)
    launcher.start()
    codes = launcher.wait(timedelta(seconds=180))
    assert all(rc == 0 for rc in codes.values()), codes
    assert launcher.restores == 1 and launcher.epoch == 1
    (restore,) = [e for e in launcher.history if e.kind == "restore"]
    assert restore.restarted == ((0, 1), (1, 1)), restore
    assert "stage(s) [1] lost" in restore.why
    assert not [e for e in launcher.history if e.kind == "rejoin"]
    posted = [a.get("event_id", "") for _, a in pub.answers]
    assert len(posted) == 2 and all("-fail-" in e for e in posted), posted  # two fails, no rejoin
    doc = pub.status()
    assert doc["state"] == "finished" and doc["failed"] == [], doc
    assert doc["restore"]["epoch"] == 1, doc
    assert_exactly_once(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, spec.workers())
    assert_peers_identical(tmp_path, job)


@pytest.mark.timeout(240)
def test_service_outage_then_kill_and_rejoin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 of the service mid-run: workers keep training on the last schedule. The service comes
    back on the same data dir and port; a worker is killed -9, the launcher posts `fail`, the
    survivors pick up the re-routed version over HTTP; the worker's warm standby re-joins (`rejoin`
    event). Final parameters equal single-process training; every micro-batch counted once."""
    monkeypatch.setenv("RECYCLE_MAX_BACKOFF_S", "0.3")  # the workers' reconnect backoff
    port, data, out = free_port(), tmp_path / "data", tmp_path / "run"
    base = f"http://127.0.0.1:{port}"
    job, n, victim = tiny_job(2, 2), 50, (1, 1)
    spec = LaunchSpec(job, asdict(CFG), n, out, pace_ms=300)  # the run outlasts the service's restart
    everyone = spec.workers()
    pub = ServicePublisher(base, TOKEN, job, max_failures=1, heartbeat_enabled=False)
    launcher = Launcher(spec, publisher=pub)
    with server(data, port, **SERVICE_ENV) as proc:
        launcher.start()
        launcher.add_standby(victim)
        supervise_until(launcher, lambda: steps(out, everyone) >= 3, "3 steps")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        down = steps(out, everyone)
        supervise_until(launcher, lambda: steps(out, everyone) >= down + 5, "5 steps with the service down")
    with server(data, port, **SERVICE_ENV) as proc:
        assert steps(out, everyone) < n - 15, "the run is nearly over: pace it slower"
        for d, s in everyone:
            assert "schedule source unreachable" in (out / f"worker_{d}_{s}.log").read_text()
        launcher.kill(victim)
        survivors = [w for w in everyone if w != victim]
        supervise_until(launcher, lambda: victim in launcher.failed and pub.version >= 2, "the fail event")
        v_fail = pub.version
        supervise_until(launcher, lambda: steps(out, survivors, v_fail) >= 2, "survivors on the new version")
        launcher.activate(victim)
        v_rejoin = pub.version
        assert v_rejoin > v_fail
        codes = launcher.wait(timedelta(seconds=180))
        doc = pub.status()
        stop(proc)
    assert all(rc == 0 for rc in codes.values()), codes
    assert doc["state"] == "finished" and doc["failed"] == [], doc
    assert [status for status, _ in pub.answers] == [200, 200], pub.answers
    assert steps(out, [victim], v_rejoin) >= 1  # the standby trained under the rejoin version
    assert_exactly_once(out, job, n)
    assert_matches_reference(out, job, n, everyone)
    assert_peers_identical(out, job)
