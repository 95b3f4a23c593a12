"""A real uvicorn process on 127.0.0.1: long-poll wake-up, concurrent events, kill -9 and restart."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import service_job_doc

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "live-controller-token"
CTL = {"Authorization": f"Bearer {TOKEN}"}
JOB: dict[str, Any] = service_job_doc(4, 3, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(data_dir: Path, port: int, **extra_env: str) -> Iterator[subprocess.Popen[bytes]]:
    """Run `python -m api.cli` (the serve command) until the block ends; wait for /readyz first."""
    env = dict(os.environ, RECYCLE_CONTROLLER_TOKEN=TOKEN, PYTHONPATH=str(ROOT), RECYCLE_MAX_WAIT_S="30")
    env.update(RECYCLE_PRECOMPUTE_TIME_LIMIT_S="1", RECYCLE_REFINE_TIME_LIMIT_S="1", **extra_env)
    cmd = [sys.executable, "-m", "api.cli", "--port", str(port), "--data-dir", str(data_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 40
        while True:
            assert proc.poll() is None, "server exited during start-up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server not ready in 40 s"
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def create_job(base: str) -> tuple[str, dict[str, str]]:
    r = httpx.post(f"{base}/v1/jobs", json={"job": JOB, "heartbeat_enabled": False}, headers=CTL, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["id"], {"Authorization": f"Bearer {r.json()['worker_token']}"}


def test_long_poll_wakes_every_poller_on_an_event(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server(tmp_path, port):
        job_id, worker = create_job(base)

        async def scenario() -> list[tuple[int, float]]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:

                async def poll(i: int) -> tuple[int, float]:
                    url = f"/v1/jobs/{job_id}/schedule?worker={i % 4},{i % 3}&after_version=1&wait=20"
                    r = await client.get(url, headers=worker)
                    return r.status_code, time.perf_counter()

                tasks = [asyncio.create_task(poll(i)) for i in range(50)]
                await asyncio.sleep(1.0)  # all pollers are waiting now
                assert not any(t.done() for t in tasks)
                t0 = time.perf_counter()
                body = {"event_id": "e1", "kind": "fail", "workers": [[1, 1]]}
                r = await client.post(f"/v1/jobs/{job_id}/events", json=body, headers=CTL)
                assert r.status_code == 200 and r.json()["version"] == 2
                return [(code, t - t0) for code, t in await asyncio.gather(*tasks)]

        results = asyncio.run(scenario())
        assert all(code == 200 for code, _ in results)
        assert max(dt for _, dt in results) < 5.0


def test_concurrent_events_serialize_into_consecutive_versions(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server(tmp_path, port):
        job_id, _ = create_job(base)
        failures = [[d, s] for d in range(3) for s in range(3)]  # pipeline 3 survives: recoverable

        async def send_all() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                posts = [
                    client.post(
                        f"/v1/jobs/{job_id}/events",
                        json={"event_id": f"f{d}{s}", "kind": "fail", "workers": [[d, s]]},
                        headers=CTL,
                    )
                    for d, s in failures
                ]
                return [r.json() for r in await asyncio.gather(*posts)]

        answers = asyncio.run(send_all())
        versions = sorted(a["version"] for a in answers)
        assert versions == list(range(2, 2 + len(failures)))
        by_version = sorted(answers, key=lambda a: a["version"])
        for i, a in enumerate(by_version):  # each answer's failure set is the previous one plus its event
            assert len(a["failed"]) == i + 1
            if i:
                assert set(map(tuple, by_version[i - 1]["failed"])) < set(map(tuple, a["failed"]))
        doc = httpx.get(f"{base}/v1/jobs/{job_id}", headers=CTL).json()
        assert doc["version"] == 1 + len(failures) and sorted(doc["failed"]) == sorted(failures)


class RawPoller(threading.Thread):
    """A worker's poll loop on one keep-alive socket; `die()` closes the socket as a killed process's
    kernel would. `query_extra` changes the spelling (a repeated parameter goes through the route)."""

    def __init__(self, port: int, job_id: str, token: str, worker: str, query_extra: str = "") -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.job_id, self.token, self.worker, self.extra = job_id, token, worker, query_extra
        self.version = 0
        self.answers: list[tuple[float, str | None]] = []  # (seconds the poll took, Recycle-Poll-Wait-Max)

    def run(self) -> None:
        buf = b""
        try:
            while True:
                path = f"/v1/jobs/{self.job_id}/schedule?worker={self.worker}&after_version={self.version}"
                auth = f"Authorization: Bearer {self.token}"
                sent = time.monotonic()
                self.sock.sendall(
                    f"GET {path}&wait=30{self.extra} HTTP/1.1\r\nHost: x\r\n{auth}\r\n\r\n".encode()
                )
                while b"\r\n\r\n" not in buf:
                    chunk = self.sock.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                fields = dict(ln.split(": ", 1) for ln in head.decode().split("\r\n")[1:])
                fields = {k.lower(): v for k, v in fields.items()}
                self.answers.append((time.monotonic() - sent, fields.get("recycle-poll-wait-max")))
                size = int(fields.get("content-length", "0"))
                while len(buf) < size:
                    buf += self.sock.recv(65536)
                buf = buf[size:]
                self.version = int(fields["etag"].strip('"'))
        except OSError:
            return

    def die(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.mark.parametrize("extra", ["", "&wait=30"], ids=["fast-path", "route"])
def test_worker_that_dies_mid_poll_is_failed_after_the_timeout_not_the_wait(
    tmp_path: Path, extra: str
) -> None:
    """A worker that polls again after every answer stays alive: it asks for a 30 s wait, the service
    grants a third of the heartbeat timeout (and says so), so its polls keep arriving. When it dies,
    the heartbeat timeout runs from its last poll's arrival, not from the end of a 30 s wait."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server(tmp_path, port, RECYCLE_HEARTBEAT_CHECK_S="0.1"):
        r = httpx.post(
            f"{base}/v1/jobs", json={"job": JOB, "heartbeat_timeout_s": 1.0}, headers=CTL, timeout=30
        )
        job_id, token = r.json()["id"], r.json()["worker_token"]
        poller = RawPoller(port, job_id, token, "1,1", extra)
        poller.start()
        time.sleep(3.0)  # three timeouts: an open poll keeps the worker alive
        assert httpx.get(f"{base}/v1/jobs/{job_id}", headers=CTL).json()["failed"] == []
        assert poller.is_alive() and poller.version >= 1
        assert len(poller.answers) >= 5  # 304 after each capped wait: the polls keep arriving
        assert all(took < 0.9 and cap == "0.333333" for took, cap in poller.answers[1:]), poller.answers
        poller.die()
        t0 = time.monotonic()
        while httpx.get(f"{base}/v1/jobs/{job_id}", headers=CTL).json()["failed"] != [[1, 1]]:
            assert time.monotonic() - t0 < 10, "dead poller not declared failed within 10 s"
            time.sleep(0.1)


@pytest.mark.parametrize("extra", ["", "&wait=30"], ids=["fast-path", "route"])
def test_partitioned_worker_is_failed_within_the_timeout_though_its_poll_socket_stays_open(
    tmp_path: Path, extra: str
) -> None:
    """A silent partition closes no socket: the cut-off worker's last poll stays parked on an open
    connection and nothing else arrives. Liveness comes only from polls arriving, so it is declared
    failed within the heartbeat timeout (+ a margin) of that poll, not when a 30 s wait runs out,
    while a healthy worker polling alongside stays alive."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    timeout_s = 1.5
    with server(tmp_path, port, RECYCLE_HEARTBEAT_CHECK_S="0.2"):
        body = {"job": JOB, "heartbeat_timeout_s": timeout_s}
        r = httpx.post(f"{base}/v1/jobs", json=body, headers=CTL, timeout=30)
        job_id, token = r.json()["id"], r.json()["worker_token"]
        healthy = RawPoller(port, job_id, token, "0,0", extra)
        healthy.start()
        cut = socket.create_connection(("127.0.0.1", port))
        path = f"/v1/jobs/{job_id}/schedule?worker=2,1&after_version=1&wait=30{extra}"
        sent = time.monotonic()
        cut.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
        # ... and from now on the partitioned worker sends nothing, reads nothing, closes nothing.
        while True:
            doc = httpx.get(f"{base}/v1/jobs/{job_id}", headers=CTL).json()
            took = time.monotonic() - sent
            if doc["failed"]:
                break
            # +3 s of margin for a loaded machine (it failed once at 2.54 s), far below the 30 s wait
            assert took < timeout_s + 3.0, "the partitioned worker was not declared failed in time"
            time.sleep(0.02)
        assert doc["failed"] == [[2, 1]], doc  # the healthy poller is alive
        assert took >= timeout_s - 0.05, f"declared failed after {took:.2f} s, before its timeout"
        assert took < timeout_s + 3.0
        assert healthy.is_alive() and len(healthy.answers) >= 3
        events = httpx.get(f"{base}/v1/jobs/{job_id}", headers=CTL).json()
        assert events["state"] == "running" and events["failed"] == [[2, 1]]
        cut.close()
        healthy.die()


def test_kill_9_mid_traffic_then_restart_keeps_every_job_and_version(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    acked: dict[str, tuple[str, dict[str, Any], int]] = {}  # event_id -> (job, body, version acknowledged)
    with server(tmp_path, port) as proc:
        jobs = [create_job(base) for _ in range(2)]

        async def traffic() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                i = 0
                while True:
                    job_id, _ = jobs[i % 2]
                    w = [(i // 2) % 4, (i // 8) % 3]
                    event_id = f"e{i}"
                    body = {
                        "event_id": event_id,
                        "kind": "fail" if (i // 2) % 2 == 0 else "rejoin",
                        "workers": [w],
                    }
                    try:
                        r = await client.post(f"/v1/jobs/{job_id}/events", json=body, headers=CTL)
                    except httpx.TransportError:
                        return  # the server is gone
                    if r.status_code in (200, 409):
                        acked[event_id] = (job_id, body, r.json().get("version", -1))
                    i += 1

        async def run_and_kill() -> None:
            task = asyncio.create_task(traffic())
            await asyncio.sleep(2.0)
            os.kill(proc.pid, signal.SIGKILL)
            await asyncio.wait_for(task, 20)

        asyncio.run(run_and_kill())
        proc.wait(timeout=10)
    assert len(acked) >= 3
    with server(tmp_path, port):
        for job_id, worker in jobs:
            doc = httpx.get(f"{base}/v1/jobs/{job_id}", headers=CTL).json()
            mine = [v for j, _, v in acked.values() if j == job_id]
            assert doc["version"] >= max(mine, default=1)  # never behind what a client was told
            r = httpx.get(f"{base}/v1/jobs/{job_id}/schedule", headers=worker)  # worker token survived
            assert r.status_code == 200 and r.json()["version"] == doc["version"]
        for job_id, body, version in acked.values():  # replay after restart: same answer, no new version
            r = httpx.post(f"{base}/v1/jobs/{job_id}/events", json=body, headers=CTL)
            if r.status_code == 200:
                assert r.json()["replayed"] and r.json()["version"] == version
            else:
                assert r.status_code == 409
