"""A real `recycle serve --database URL` process for the PostgreSQL tests (tests/test_api_pg*.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "pg-controller-token"
CTL = {"Authorization": f"Bearer {TOKEN}"}
_LISTENING = re.compile(r"listening on (http://\S+)")


class Replica:
    """One service process on `url`'s database, on a free port; `.base` is its http://host:port."""

    def __init__(self, url: str, log: Path, wait: bool = True, **extra_env: str) -> None:
        env = dict(os.environ, RECYCLE_CONTROLLER_TOKEN=TOKEN, PYTHONPATH=str(ROOT), RECYCLE_MAX_WAIT_S="30")
        env.update(RECYCLE_PRECOMPUTE_TIME_LIMIT_S="1", RECYCLE_REFINE_TIME_LIMIT_S="1")
        env.update(extra_env)
        cmd = [sys.executable, "-m", "api.cli", "--port", "0", "--database", url, "--no-access-log"]
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.base = self.wait_ready() if wait else ""

    def wait_ready(self) -> str:
        """Wait until it listens and is ready (60 s at most); its base URL."""
        deadline = time.monotonic() + 60
        base = None
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            assert self.proc.poll() is None, f"replica exited during start-up:\n{text[-3000:]}"
            if base is None and (m := _LISTENING.search(text)):
                base = m.group(1)
            if base is not None:
                try:
                    if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                        self.base = base
                        return base
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        raise AssertionError(f"replica not ready in 60 s:\n{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL after 15 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
        if self.proc.returncode is None:
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def create_job(base: str, job: dict[str, Any], **extra: Any) -> tuple[str, dict[str, str]]:
    body = {"job": job, "heartbeat_enabled": False, "max_failures": 1, **extra}
    r = httpx.post(f"{base}/v1/jobs", json=body, headers=CTL, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["id"], {"Authorization": f"Bearer {r.json()['worker_token']}"}


def event(base: str, job_id: str, event_id: str, kind: str, workers: list[list[int]]) -> httpx.Response:
    body: dict[str, Any] = {"event_id": event_id, "kind": kind, "workers": workers}
    if kind == "slow":
        body["factor"] = 1.5
    return httpx.post(f"{base}/v1/jobs/{job_id}/events", json=body, headers=CTL, timeout=30)
