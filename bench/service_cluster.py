"""The services bench.service measures: `replicas` real `recycle serve` processes on 127.0.0.1, on one
SQLite data directory (one replica: the embedded default) or on one PostgreSQL database (a throw-away
cluster from bench/pg_cluster.py), plus the CPU seconds their process trees (and PostgreSQL's) used.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-controller-token"
CTL = {"Authorization": f"Bearer {TOKEN}"}


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; 0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree(pids: list[int]) -> list[int]:
    """`pids` and all their descendants (from /proc/*/stat parent ids)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    out, frontier = list(pids), list(pids)
    while frontier:
        frontier = [c for c, p in parent.items() if p in frontier]
        out += frontier
    return out


def port_free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server on port {port} exited during start-up (code {proc.returncode})")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server on port {port} not ready within {timeout:.0f} s")


@dataclass
class Service:
    """Running replicas: their base URLs and the pids whose CPU counts as the service's."""

    backend: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    db_pid: int | None = None  # the PostgreSQL postmaster (its backends are its children)

    @property
    def bases(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def cpu_s(self) -> float:
        """CPU seconds of every replica's process tree (solver pools too) and of PostgreSQL's."""
        roots = [p.pid for p in self.procs] + ([self.db_pid] if self.db_pid else [])
        return sum(proc_cpu_s(pid) for pid in tree(roots))

    def connected_pollers(self, client: httpx.Client) -> float:
        """recycle_connected_pollers summed over the replicas."""
        total = 0.0
        for base in self.bases:
            text = client.get(f"{base}/metrics").text
            line = next((ln for ln in text.splitlines() if ln.startswith("recycle_connected_pollers")), "x 0")
            total += float(line.split()[-1])
        return total


def start_replica(
    port: int, data_dir: str, database: str | None, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "api.cli", "--port", str(port), "--data-dir", data_dir]
    cmd += ["--log-level", "warning", "--no-access-log", "--keep-alive", "600"]
    if database is not None:
        cmd += ["--database", database]
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


@contextlib.contextmanager
def service(backend: str, replicas: int) -> Iterator[Service]:
    """`replicas` started services on `backend` ("sqlite": must be 1; "postgres"); stopped on exit."""
    if backend == "sqlite" and replicas != 1:
        raise SystemExit("--replicas: the SQLite store serves from one process (use --backend postgres)")
    env = dict(os.environ, RECYCLE_CONTROLLER_TOKEN=TOKEN, PYTHONPATH=str(ROOT))
    env.setdefault("RECYCLE_PRECOMPUTE_TIME_LIMIT_S", "2")
    env["RECYCLE_MAX_WAIT_S"] = "300"  # 10,000 pollers may take longer to connect than the default cap
    svc = Service(backend)
    with contextlib.ExitStack() as stack:
        database = None
        if backend == "postgres":
            from bench.pg_cluster import pg_cluster

            pg = stack.enter_context(pg_cluster(max_connections=100 + 20 * replicas))
            database = pg.url
            svc.db_pid = int((pg.data / "postmaster.pid").read_text().split()[0])
        data = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-service-"))
        try:
            for k in range(replicas):
                port = port_free()
                os.makedirs(f"{data}/r{k}")  # SQLite: the one replica's store; PostgreSQL: unused
                svc.procs.append(start_replica(port, f"{data}/r{k}", database, env))
                svc.ports.append(port)
            for proc, port in zip(svc.procs, svc.ports, strict=True):
                wait_ready(proc, port)
            yield svc
        finally:
            for proc in svc.procs:
                proc.terminate()
            for proc in svc.procs:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
