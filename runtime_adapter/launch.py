"""`recycle launch`: start a D x P job on one machine and keep it going when workers die.

Unlike torchrun's agent, a dead worker does not take the others down: the launcher hosts the store,
notices the death and reports it to its publisher (publishers.py): either a schedule file it writes
from `schedule_for(failed set)` (the planner, or a directory of precomputed schedules: the launcher
itself never plans), or the planner service, whose job it controls (fail / rejoin events). `restart`
brings a worker back (it re-joins from a peer) and reports the rejoin.

When a failure set is unrecoverable (every worker of a stage dead, as the launcher's failed set shows,
the service's 409 answer says, or a worker that saw the job's `needs_restore` state exits with
EXIT_NEEDS_RESTORE), `restore` kills the survivors, tells the publisher every worker is back and
restarts all D x P workers with `--resume` from the newest complete checkpoint.
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

from planner.contract import JobSpec
from runtime_adapter.assignment import Worker
from runtime_adapter.model import GPTConfig
from runtime_adapter.publishers import FilePublisher, Publisher, ScheduleFor, lost_stages, publish
from runtime_adapter.worker import EXIT_NEEDS_RESTORE

logger = logging.getLogger(__name__)

SCHEDULE_FILE = "schedule.json"
__all__ = ["SCHEDULE_FILE", "LaunchSpec", "Launcher", "ScheduleFor", "publish"]


@dataclass
class LaunchSpec:
    """What to start: pure data, so a dry run can show every worker's command line."""

    job: JobSpec
    cfg: GPTConfig
    num_iterations: int
    out_dir: Path
    backend: str = "gloo"
    fail_at: dict[Worker, tuple[int, str]] = field(default_factory=dict)
    checkpoint_every: int = 0
    checkpoint_dir: Path | None = None  # default: <out_dir>/checkpoints
    pace_ms: float = 0.0

    @property
    def checkpoints(self) -> Path:
        """The checkpoint directory."""
        return self.checkpoint_dir if self.checkpoint_dir is not None else self.out_dir / "checkpoints"

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
        source_args: list[str] | None = None,
        resume: bool = False,
    ) -> list[str]:
        """The command line of `worker`'s process (a re-joiner's if `rejoin`; a warm standby's if
        `standby_key`, which waits for the launcher to set that store key before joining; one that
        starts from the newest complete checkpoint if `resume`). `source_args`: where it polls
        (default: the schedule file in out_dir). The spec's `fail_at` applies to first starts only."""
        d, s = worker
        if source_args is None:
            source_args = ["--schedule-file", str(self.out_dir / SCHEDULE_FILE)]
        cmd = [
            sys.executable, "-m", "runtime_adapter.cli", "worker",
            "--job", str(self.out_dir / "job.json"),
            "--pipeline", str(d), "--stage", str(s),
            *source_args,
            "--store", f"127.0.0.1:{store_port}",
            "--iterations", str(self.num_iterations),
            "--model", json.dumps(asdict(self.cfg)),
            "--out", str(self.out_dir),
            "--backend", self.backend,
        ]  # fmt: skip
        if self.checkpoint_every > 0:
            cmd += ["--checkpoint-every", str(self.checkpoint_every)]
        cmd += ["--checkpoint-dir", str(self.checkpoints)]
        if self.pace_ms > 0:
            cmd += ["--pace-ms", f"{self.pace_ms:g}"]
        if rejoin:
            cmd.append("--rejoin")
        if resume:
            cmd.append("--resume")
        if standby_key is not None:
            cmd += ["--standby-key", standby_key]
        fail = fail_at if (rejoin or resume) else self.fail_at.get(worker)
        if fail is not None:
            cmd += ["--fail-at", f"{fail[0]}:{fail[1]}"]
        return cmd

    def dry_run(self, store_port: int = 0, source_args: list[str] | None = None) -> str:
        """One line per worker: its command."""
        return "\n".join(
            f"{list(w)}: {' '.join(self.command(w, store_port, source_args=source_args))}"
            for w in self.workers()
        )


class Launcher:
    """Owns the store and the worker processes of one job on this machine."""

    def __init__(
        self,
        spec: LaunchSpec,
        schedule_for: ScheduleFor | None = None,
        publisher: Publisher | None = None,
        max_restores: int = 3,
        report_failures: bool = True,
    ) -> None:
        """`publisher` (default: a FilePublisher over `schedule_for`) gets every failure-set change;
        `report_failures=False` leaves deaths to the service's heartbeat timeout."""
        if publisher is None:
            if schedule_for is None:
                raise ValueError("give a publisher or a schedule_for")
            publisher = FilePublisher(spec.out_dir / SCHEDULE_FILE, spec.job, schedule_for)
        self.spec, self.publisher = spec, publisher
        self.max_restores, self.report_failures = max_restores, report_failures
        self.restores = 0
        self.procs: dict[Worker, subprocess.Popen[bytes]] = {}
        self.failed: set[Worker] = set()
        self.finished: set[Worker] = set()
        self.events: list[tuple[float, str, Worker]] = []
        self.store: dist.TCPStore | None = None
        self.standbys: dict[Worker, list[tuple[str, subprocess.Popen[bytes]]]] = {}
        self.retired: list[subprocess.Popen[bytes]] = []
        self.num_standbys = 0

    @property
    def schedule_path(self) -> Path:
        """The schedule file the workers poll."""
        return self.spec.out_dir / SCHEDULE_FILE

    @property
    def version(self) -> int:
        """The newest schedule version the publisher made (as far as the launcher knows)."""
        return self.publisher.version

    def start(self) -> None:
        """Host the store, publish version 1 and start every worker."""
        self.spec.out_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.out_dir / "job.json").write_text(self.spec.job.model_dump_json())
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.publisher.start()
        for w in self.spec.workers():
            self._spawn(w, rejoin=False)

    def _spawn(
        self,
        w: Worker,
        rejoin: bool,
        standby_key: str | None = None,
        fail_at: tuple[int, str] | None = None,
        resume: bool = False,
    ) -> subprocess.Popen[bytes]:
        assert self.store is not None
        name = f"worker_{w[0]}_{w[1]}" + (
            "" if standby_key is None else f"_standby{standby_key.rsplit('.', 1)[1]}"
        )
        log = (self.spec.out_dir / f"{name}.log").open("ab")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
        cmd = self.spec.command(
            w, self.store.port, rejoin, standby_key, fail_at, self.publisher.worker_args(), resume
        )
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
        self.publisher.report("rejoin", [w], "warm standby activated")
        self.store.set(key, str(self.version))
        self.events.append((time.monotonic(), "rejoin", w))

    def poll(self) -> list[Worker]:
        """Reap exited workers and report the ones that died; restore from a checkpoint when the
        failure set is unrecoverable. The newly failed."""
        late_lost = self.publisher.flush()  # a queued event the service now answered with 409
        died, restore = [], False
        for w, p in self.procs.items():
            if w in self.finished or w in self.failed or p.poll() is None:
                continue
            if p.returncode == 0:
                self.finished.add(w)
            else:
                logger.warning("worker %s exited with %s", list(w), p.returncode)
                self.events.append((time.monotonic(), "died", w))
                died.append(w)
                restore |= p.returncode == EXIT_NEEDS_RESTORE
        running = len(self.procs) - len(self.failed) - len(died) - len(self.finished)
        self.failed.update(died)
        if late_lost and running > 0:
            self.restore(f"stages {late_lost} lost (late answer)")
            return died
        if not died or (running == 0 and not restore):
            return died
        lost = lost_stages(frozenset(self.failed), self.spec.job.num_pipelines, self.spec.job.num_stages)
        if self.report_failures and not restore:  # reported even when lost: the service records it
            reported = self.publisher.report("fail", died, "process exited").lost_stages
            lost = lost or reported
        if lost or restore:
            self.restore(f"stages {lost} lost" if lost else "a worker saw needs_restore")
        return died

    def restore(self, why: str) -> None:
        """Stop every worker, tell the publisher all are back, restart all D x P with --resume."""
        self.restores += 1
        if self.restores > self.max_restores:
            self.terminate()
            raise RuntimeError(f"{why}: more than {self.max_restores} restores, giving up")
        logger.error("%s: restoring every worker from the newest complete checkpoint", why)
        self.terminate()
        self.retired.extend(self.procs.values())
        self.standbys.clear()
        self.failed.clear()
        self.finished.clear()
        version = self.publisher.restored()
        logger.info("restore: schedule v%d, restarting %d workers", version, len(self.procs))
        self.events.append((time.monotonic(), "restore", (-1, -1)))
        for w in self.spec.workers():
            self._spawn(w, rejoin=False, resume=True)

    def kill(self, w: Worker) -> None:
        """SIGKILL a worker (fault injection from outside)."""
        self.procs[w].kill()

    def restart(self, w: Worker) -> None:
        """Start a failed worker again: it re-joins from a peer under the next version."""
        self.failed.discard(w)
        self._spawn(w, rejoin=True)
        self.events.append((time.monotonic(), "rejoin", w))
        self.publisher.report("rejoin", [w], "restarted")

    def wait(
        self, timeout: timedelta, on_tick: Callable[[Launcher], None] | None = None
    ) -> dict[Worker, int]:
        """Supervise until every process has exited; kill all and raise TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            all_exited = all(p.poll() is not None for p in self.procs.values())
            self.poll()  # handles every exit seen above (a restore starts new processes)
            if all_exited and all(p.poll() is not None for p in self.procs.values()):
                break
            if on_tick is not None:
                on_tick(self)
            if time.monotonic() > deadline:
                self.terminate()
                raise TimeoutError(f"job did not finish within {timeout}")
            time.sleep(0.02)
        self.publisher.finish()
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
