"""`recycle launch`: start a D x P job on one machine and keep it going when workers die.

Unlike torchrun's agent, a dead worker does not take the others down: the launcher hosts the store,
notices the death, asks `schedule_for(failed set)` for the schedule of the new failure set (the
planner, the service, or a directory of precomputed schedules: the launcher itself never plans) and
publishes it as the next version of the schedule file the workers poll. `restart` brings a worker back
(it re-joins from a peer) and publishes the schedule of the smaller failure set.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from planner.contract import JobSpec, Schedule
from runtime_adapter.assignment import Worker
from runtime_adapter.model import GPTConfig

logger = logging.getLogger(__name__)

SCHEDULE_FILE = "schedule.json"
ScheduleFor = Callable[[frozenset[Worker]], Schedule]


def publish(path: Path, version: int, schedule: Schedule) -> None:
    """Atomically replace the schedule file with version `version`."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    doc = {"version": version, "schedule": json.loads(schedule.model_dump_json(exclude_none=True))}
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


@dataclass
class LaunchSpec:
    """What to start: pure data, so a dry run can show every worker's command line."""

    job: JobSpec
    cfg: GPTConfig
    num_iterations: int
    out_dir: Path
    backend: str = "gloo"
    fail_at: dict[Worker, tuple[int, str]] = field(default_factory=dict)

    def workers(self) -> list[Worker]:
        """All D x P workers."""
        return [(d, s) for d in range(self.job.num_pipelines) for s in range(self.job.num_stages)]

    def command(
        self,
        worker: Worker,
        store_port: int,
        rejoin: bool = False,
        standby_key: str | None = None,
        fail_at: tuple[int, str] | None = None,
    ) -> list[str]:
        """The command line of `worker`'s process (a re-joiner's if `rejoin`; a warm standby's if
        `standby_key`, which waits for the launcher to set that store key before joining)."""
        d, s = worker
        cmd = [
            sys.executable, "-m", "runtime_adapter.cli", "worker",
            "--job", str(self.out_dir / "job.json"),
            "--pipeline", str(d), "--stage", str(s),
            "--schedule-file", str(self.out_dir / SCHEDULE_FILE),
            "--store", f"127.0.0.1:{store_port}",
            "--iterations", str(self.num_iterations),
            "--model", json.dumps(asdict(self.cfg)),
            "--out", str(self.out_dir),
            "--backend", self.backend,
        ]  # fmt: skip
        if rejoin:
            cmd.append("--rejoin")
        if standby_key is not None:
            cmd += ["--standby-key", standby_key]
        fail = fail_at if rejoin else self.fail_at.get(worker)
        if fail is not None:
            cmd += ["--fail-at", f"{fail[0]}:{fail[1]}"]
        return cmd

    def dry_run(self, store_port: int = 0) -> str:
        """One line per worker: its command."""
        return "\n".join(f"{list(w)}: {' '.join(self.command(w, store_port))}" for w in self.workers())


class Launcher:
    """Owns the store and the worker processes of one job on this machine."""

    def __init__(self, spec: LaunchSpec, schedule_for: ScheduleFor) -> None:
        self.spec, self.schedule_for = spec, schedule_for
        self.procs: dict[Worker, subprocess.Popen[bytes]] = {}
        self.failed: set[Worker] = set()
        self.finished: set[Worker] = set()
        self.version = 0
        self.events: list[tuple[float, str, Worker]] = []
        self.store: dist.TCPStore | None = None
        self.standbys: dict[Worker, list[tuple[str, subprocess.Popen[bytes]]]] = {}
        self.retired: list[subprocess.Popen[bytes]] = []
        self.num_standbys = 0

    @property
    def schedule_path(self) -> Path:
        """The schedule file the workers poll."""
        return self.spec.out_dir / SCHEDULE_FILE

    def _publish(self) -> None:
        self.version += 1
        publish(self.schedule_path, self.version, self.schedule_for(frozenset(self.failed)))
        logger.info("published schedule v%d for failed %s", self.version, sorted(self.failed))

    def start(self) -> None:
        """Host the store, publish version 1 and start every worker."""
        self.spec.out_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.out_dir / "job.json").write_text(self.spec.job.model_dump_json())
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self._publish()
        for w in self.spec.workers():
            self._spawn(w, rejoin=False)

    def _spawn(
        self, w: Worker, rejoin: bool, standby_key: str | None = None, fail_at: tuple[int, str] | None = None
    ) -> subprocess.Popen[bytes]:
        assert self.store is not None
        name = f"worker_{w[0]}_{w[1]}" + (
            "" if standby_key is None else f"_standby{standby_key.rsplit('.', 1)[1]}"
        )
        log = (self.spec.out_dir / f"{name}.log").open("ab")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
        cmd = self.spec.command(w, self.store.port, rejoin, standby_key, fail_at)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if standby_key is None:
            self.procs[w] = proc
        return proc

    def add_standby(self, w: Worker, fail_at: tuple[int, str] | None = None) -> None:
        """Start a warm replacement for `w` now (import, store connection); `activate` makes it join.
        `fail_at` counts iterations from the one it joins at."""
        self.num_standbys += 1
        key = f"recycle/activate/{w[0]}.{w[1]}.{self.num_standbys}"
        self.standbys.setdefault(w, []).append((key, self._spawn(w, True, key, fail_at)))

    def activate(self, w: Worker) -> None:
        """Bring failed worker `w` back from its next standby, under a new version."""
        assert self.store is not None and w in self.failed
        key, proc = self.standbys[w].pop(0)
        self.retired.append(self.procs[w])
        self.procs[w] = proc
        self.failed.discard(w)
        self._publish()
        self.store.set(key, str(self.version))
        self.events.append((time.monotonic(), "rejoin", w))

    def poll(self) -> list[Worker]:
        """Reap exited workers; publish a new version for the ones that died. The newly failed."""
        died = []
        for w, p in self.procs.items():
            if w in self.finished or w in self.failed or p.poll() is None:
                continue
            if p.returncode == 0:
                self.finished.add(w)
            else:
                logger.warning("worker %s exited with %s", list(w), p.returncode)
                self.events.append((time.monotonic(), "died", w))
                died.append(w)
        if died and len(self.finished) < len(self.procs) - len(self.failed) - len(died):
            self.failed.update(died)
            self._publish()
        else:
            self.failed.update(died)
        return died

    def kill(self, w: Worker) -> None:
        """SIGKILL a worker (fault injection from outside)."""
        self.procs[w].kill()

    def restart(self, w: Worker) -> None:
        """Start a failed worker again: it re-joins from a peer under the next version."""
        self.failed.discard(w)
        self._spawn(w, rejoin=True)
        self.events.append((time.monotonic(), "rejoin", w))
        self._publish()

    def wait(
        self, timeout: timedelta, on_tick: Callable[[Launcher], None] | None = None
    ) -> dict[Worker, int]:
        """Supervise until every process has exited; kill all and raise TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout.total_seconds()
        while any(p.poll() is None for p in self.procs.values()):
            self.poll()
            if on_tick is not None:
                on_tick(self)
            if time.monotonic() > deadline:
                self.terminate()
                raise TimeoutError(f"job did not finish within {timeout}")
            time.sleep(0.02)
        self.poll()
        for spares in self.standbys.values():
            for _, p in spares:
                p.kill()
                p.wait()
        return {w: int(p.returncode) for w, p in self.procs.items()}

    def terminate(self) -> None:
        """Kill every worker (and standby) this launcher started."""
        spares = [p for v in self.standbys.values() for _, p in v]
        for p in [*self.procs.values(), *spares]:
            if p.poll() is None:
                p.kill()
                p.wait()
