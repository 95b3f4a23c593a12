"""A throw-away Ray cluster on this machine for `python -m bench.precompute` and tests/test_whatif_ray.py.

A head and further node processes, each started by `ray start` in a process group of its own with
its own free ports and a private temp directory. Ray's daemons keep that group and its workers are
their children, so `kill_node` and `stop` SIGKILL exactly this cluster's processes (the group and
its descendants, from /proc), never another cluster's; `ray stop` would kill every Ray process of
the machine. The nodes stay in the caller's session: with the kernel's autogroup scheduling a
session of their own would give them a CPU share of their own on a shared machine (and a benchmark
against local processes an unfair edge).
`ray start` is run from this Python's bin directory, so the workers run this Python (and import
this project, installed in it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

# quick node-death detection (defaults: several seconds per missed health check, 5 misses)
FAST_HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


_GIVEN: set[int] = set()  # every port free_port handed out in this process


def free_port() -> int:
    """A TCP port nobody listens on now and that this process has not handed out before: the OS can
    return a port it just gave again, and two Ray components of one node then collided (`ray start`
    refused: "metrics_export is trying to use a port number ... used by other components")."""
    while True:
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def _processes() -> dict[int, tuple[int, int, str]]:
    """Every live process: pid -> (parent pid, process group, start time), from /proc (no zombies)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if len(fields) > 19 and fields[0] != "Z":  # a zombie is dead already
            table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[19])
    return table


def group_tree(pgid: int) -> set[tuple[int, str]]:
    """(pid, start time) of the processes of group `pgid` and all their descendants (Ray's workers
    put themselves in groups of their own, under their raylet)."""
    table = _processes()
    found = {pid for pid, (_, group, _) in table.items() if group == pgid}
    grew = True
    while grew:
        children = {pid for pid, (ppid, _, _) in table.items() if ppid in found} - found
        found |= children
        grew = bool(children)
    return {(pid, table[pid][2]) for pid in found}


def process_titles(pgid: int) -> list[str]:
    """The command lines (as Ray sets them: `ray::_plan_task` while a task runs) of group_tree(pgid)."""
    titles = []
    for pid, _ in group_tree(pgid):
        try:
            titles.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
        except OSError:
            continue
    return titles


class LocalRayCluster:
    """`nodes` Ray node processes (the first one the head) with `cpus` CPUs each."""

    def __init__(self, nodes: int = 2, cpus: int = 1, start_timeout_s: float = 60.0) -> None:
        self.nodes, self.cpus, self.start_timeout_s = nodes, cpus, start_timeout_s
        self.temp_dir = tempfile.mkdtemp(prefix="rcy-ray-", dir="/tmp")  # short: socket paths < 108 chars
        self.groups: list[int] = []
        self.address = ""  # HOST:PORT of the head
        self.client_address = ""  # ray://HOST:PORT of its Ray Client server (needs ray[client])

    def _ray_start(self, args: list[str]) -> str:
        ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
        log = Path(self.temp_dir) / f"start-{len(self.groups)}.log"
        ports = ["--node-manager-port", "--object-manager-port", "--metrics-export-port"]
        ports += ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port"]
        cmd = [ray_bin, "start", *args, "--num-cpus", str(self.cpus), "--disable-usage-stats"]
        cmd += ["--object-store-memory", str(100 * 2**20), "--temp-dir", self.temp_dir]
        for flag in ports:
            cmd += [flag, str(free_port())]
        with log.open("w") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0,
                env={**os.environ, **FAST_HEALTH_CHECKS, "RAY_USAGE_STATS_ENABLED": "0"},
            )
        self.groups.append(proc.pid)
        try:
            rc = proc.wait(timeout=self.start_timeout_s)
        except subprocess.TimeoutExpired:
            rc = -1
        text = log.read_text()
        if rc != 0:
            raise RuntimeError(f"`ray start` failed ({rc}): {text[-2000:]}")
        return text

    def start(self) -> str:
        """Start the head, then the other nodes; returns the cluster's address (HOST:PORT)."""
        try:
            client_port = free_port()
            head_args = ["--head", "--include-dashboard", "false"]
            head_args += ["--ray-client-server-port", str(client_port)]
            for flag in ("--port", "--dashboard-port"):
                head_args += [flag, str(free_port())]
            head = self._ray_start(head_args)
            found = re.search(r"ray start --address='([^']+)'", head)
            if not found:
                raise RuntimeError(f"no address in the head's output: {head[-2000:]}")
            self.address = found.group(1)
            self.client_address = f"ray://{self.address.rpartition(':')[0]}:{client_port}"
            for _ in range(self.nodes - 1):
                self._ray_start(["--address", self.address])
        except BaseException:
            self.stop()
            raise
        return self.address

    def kill_node(self, index: int) -> None:
        """SIGKILL every process of node `index` (its raylet, agents and workers): a node dying."""
        self._kill(group_tree(self.groups[index]))

    @staticmethod
    def _kill(procs: set[tuple[int, str]]) -> None:
        live = _processes()
        for pid, started in procs:
            if pid in live and live[pid][2] == started:  # not a later process that reuses the pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Kill every process of this cluster, workers included, and wait until none is left."""
        seen: set[tuple[int, str]] = set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            trees = set().union(*(group_tree(g) for g in self.groups))
            seen |= trees
            self._kill(seen)  # the whole tree at once: a worker whose raylet died has another parent
            if not trees:
                break
            time.sleep(0.1)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
