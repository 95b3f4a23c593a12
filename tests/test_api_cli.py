"""The serve command: refuses bad flags and a missing controller token with one line and exit code 2;
stops cleanly (exit 0, no traceback, no leaked semaphores) on SIGTERM or Ctrl+C soon after start."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx

from api.cli import add_serve_parser
from tests.jobs import service_job_doc

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(60)


def test_serve_refuses_without_token(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "api.cli", "--data-dir", str(tmp_path), "--port", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "RECYCLE_CONTROLLER_TOKEN" in r.stderr


@pytest.mark.parametrize(
    "var",
    ["RECYCLE_HEARTBEAT_TIMEOUT_S=inf", "RECYCLE_DATABASE_POOL_SIZE=nan", "RECYCLE_DATABASE_TIMEOUT_S=1e999"],
)
def test_serve_refuses_a_bad_setting_in_one_line(tmp_path: Path, var: str) -> None:
    name, _, value = var.partition("=")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RECYCLE_CONTROLLER_TOKEN": "t" * 20}
    env[name] = value
    r = subprocess.run(
        [sys.executable, "-m", "api.cli", "--data-dir", str(tmp_path), "--port", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and name in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


def test_serve_parser_flags() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["serve", "--host", "0.0.0.0", "--port", "9", "--data-dir", "d", "--insecure-dev"]
    )
    assert (args.host, args.port, args.data_dir, args.insecure_dev) == ("0.0.0.0", 9, "d", True)
    assert args.func.__name__ == "cmd_serve"


def run_serve(args: list[str], tmp_path: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RECYCLE_CONTROLLER_TOKEN": "t", **extra_env}
    cmd = [sys.executable, "-m", "api.cli", "--data-dir", str(tmp_path / "data"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "99999"], "99999 is not a port number"),
        (["--port", "-1"], "is not a port number"),
        (["--port", "80x"], "is not a port number"),
        (["--host", "not a host!"], "neither an IP address nor a host name"),
        (["--keep-alive", "0"], "not between 1 and 3600"),
        (["--keep-alive", "nan"], "not between 1 and 3600"),
        (["--log-level", "loud"], "invalid choice"),
    ],
)
def test_serve_rejects_bad_flags(args: list[str], message: str, tmp_path: Path) -> None:
    r = run_serve(args, tmp_path)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "data").exists()  # nothing started


def test_serve_rejects_unusable_data_dir_and_busy_port(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    r = run_serve(["--port", "0"], tmp_path / "file")  # data dir below a regular file
    assert r.returncode == 2 and r.stderr.startswith("error: --data-dir") and "Traceback" not in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = run_serve(["--port", str(busy.getsockname()[1])], tmp_path)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1:" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one line, before any process was started
    r = run_serve(["--port", "0", "--host", "no-such-host.invalid"], tmp_path)
    assert r.returncode == 2 and "--host no-such-host.invalid: cannot resolve it" in r.stderr, r.stderr
    r = run_serve(["--port", "0"], tmp_path, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "file"))
    assert r.returncode == 2 and "PROMETHEUS_MULTIPROC_DIR" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_serve_rejects_a_corrupt_store_file(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "recycle.sqlite3").write_text("garbage")
    r = run_serve(["--port", "0"], tmp_path)
    assert r.returncode == 2 and "recycle.sqlite3 is not a usable SQLite database" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_serve_port_values_parse() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    for text, value in (("1", 1), ("65535", 65535), ("0", 0)):
        assert parser.parse_args(["serve", "--port", text]).port == value
    assert parser.parse_args(["serve", "--host", "::1"]).host == "::1"
    assert parser.parse_args(["serve", "--host", "planner.example"]).host == "planner.example"
    assert parser.parse_args(["serve", "--keep-alive", "2.6"]).keep_alive == 3


def start_serve(tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    """The real service on a free port (--port 0 prints it), ready; (process, base URL)."""
    env = dict(os.environ, RECYCLE_CONTROLLER_TOKEN="t", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "api.cli", "--port", "0", "--data-dir", str(tmp_path)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stderr is not None
    line = proc.stderr.readline()
    match = re.fullmatch(r"recycle serve: listening on http://127\.0\.0\.1:(\d+)\n", line)
    assert match, line
    base = f"http://127.0.0.1:{match.group(1)}"
    deadline = time.monotonic() + 30
    while True:  # the port is bound before start-up: connections wait in the backlog
        try:
            if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("how", ["SIGTERM to the service", "SIGINT to its process group (Ctrl+C)"])
def test_quick_stop_is_clean(how: str, tmp_path: Path) -> None:
    """Start the real service, register a job so that the solver pools are busy, and stop it a
    moment later: exit code 0, no traceback, no leaked semaphores."""
    proc, base = start_serve(tmp_path)
    try:
        job = {"job": service_job_doc(3, 3, 4), "heartbeat_enabled": False}
        r = httpx.post(f"{base}/v1/jobs", json=job, headers={"Authorization": "Bearer t"}, timeout=30)
        assert r.status_code == 201
        time.sleep(0.3)
        if how.startswith("SIGTERM"):
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        stop(proc)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "leaked" not in err and "Error" not in err, err


def test_a_stop_ends_parked_polls_at_once_and_fails_no_worker(tmp_path: Path) -> None:
    """Before: SIGTERM waited for the last parked long-poll (a controller's 30 s), while the
    heartbeat checks ran on and failed every worker that could not reach the stopping service; a
    restart then restored the job from the initial parameters. Now the polls end at once (304) and
    no heartbeat check runs once the stop has begun."""
    proc, base = start_serve(tmp_path)
    ctl = {"Authorization": "Bearer t"}
    try:
        doc = {"job": service_job_doc(2, 2, 4), "heartbeat_timeout_s": 2.0}
        r = httpx.post(f"{base}/v1/jobs", json=doc, headers=ctl, timeout=30)
        assert r.status_code == 201, r.text
        job_id, worker = r.json()["id"], {"Authorization": f"Bearer {r.json()['worker_token']}"}
        for d, s in [(0, 0), (0, 1), (1, 0), (1, 1)]:  # every worker polled: all tracked
            url = f"{base}/v1/jobs/{job_id}/schedule?worker={d},{s}"
            assert httpx.get(url, headers=worker, timeout=10).status_code == 200
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(1) as pool:
            parked = pool.submit(client.get, f"{base}/v1/jobs/{job_id}/schedule?after_version=99&wait=30",
                                 headers=ctl)  # fmt: skip
            time.sleep(0.5)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert parked.result(timeout=30).status_code == 304
            proc.communicate(timeout=30)
            took = time.monotonic() - t0
        assert proc.returncode == 0 and took < 5.0, took  # the heartbeat timeout (2 s) passed before
    finally:
        stop(proc)
    proc, base = start_serve(tmp_path)
    try:
        got = httpx.get(f"{base}/v1/jobs/{job_id}", headers=ctl, timeout=10).json()
        assert (got["version"], got["failed"]) == (1, []), got
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        stop(proc)


def test_a_second_service_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    """Before: it started, served stale versions from its own memory and refused every event with a
    503 (version conflict) that clients retry forever."""
    proc, _ = start_serve(tmp_path / "data")
    try:
        r = run_serve(["--port", "0"], tmp_path)
        assert r.returncode == 2 and "another recycle serve uses it" in r.stderr, r.stderr
        assert f"(pid {proc.pid})" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        stop(proc)
    proc, _ = start_serve(tmp_path / "data")  # the lock went with the first process
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    stop(proc)
    assert proc.returncode == 0
