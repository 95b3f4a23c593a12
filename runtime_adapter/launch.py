"""`recycle launch`: start a D x P job on one machine and keep it going when workers die.

Unlike torchrun's agent, a dead worker does not take the others down: the launcher hosts the store
(or uses an external one, `LaunchSpec.store`, e.g. a `recycle store`, which may die and be restarted:
store.py), notices the death and reports it to its publisher (publishers.py): either a schedule file it writes
from `schedule_for(failed set)` (the planner, or a directory of precomputed schedules: the launcher
itself never plans), or the planner service, whose job it controls (fail / rejoin events). `restart`
brings a worker back (it re-joins from a peer) and reports the rejoin.

A worker on its first start that exits with an error (exit code > 0 other than the protocol codes
3-5) before its first step is a configuration error, not a failure to recover from: `poll` raises
WorkerStartupError with the end of its log, and the launch stops.

When a failure set is unrecoverable (every worker of a stage dead, as the launcher's failed set shows,
the service's 409 answer says, or a worker that saw the job's `needs_restore` state exits with
EXIT_NEEDS_RESTORE), `restore` kills the survivors, tells the publisher every worker is back and
restarts all D x P workers with `--resume` from the newest complete checkpoint. With checkpointing
off (checkpoint_every 0) there is nothing to restore from: it raises LaunchError.

Every death, re-join and restore is recorded in `history` (summary.LaunchEvent) for the summary.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from runtime_adapter import checkpoint
from runtime_adapter.assignment import Worker
from runtime_adapter.launch_spec import SCHEDULE_FILE, LaunchSpec
from runtime_adapter.progress import last_step, log_error
from runtime_adapter.publishers import FilePublisher, Publisher, ScheduleFor, lost_stages, publish
from runtime_adapter.settings import runtime_settings
from runtime_adapter.store import StoreClient, StoreUnavailable
from runtime_adapter.summary import LaunchEvent
from runtime_adapter.worker import EXIT_DROPPED, EXIT_NEEDS_RESTORE, EXIT_REJECTED

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEDULE_FILE",
    "LaunchError",
    "LaunchSpec",
    "Launcher",
    "ScheduleFor",
    "WorkerStartupError",
    "publish",
]


class LaunchError(RuntimeError):
    """The launch cannot go on (a stage lost without a checkpoint, too many restores)."""


class WorkerStartupError(LaunchError):
    """A worker exited with an error before its first step, or with exit 2 (bad input) at any time: a
    configuration error."""

    def __init__(self, worker: Worker, code: int, message: str, log: Path, at_start: bool = True) -> None:
        self.worker, self.code, self.log = worker, code, log
        when = "during start-up" if at_start else "with bad input"
        super().__init__(
            f"worker {list(worker)} stopped {when} with exit code {code}: {message} (log: {log})"
        )


PROTOCOL_EXITS = (EXIT_NEEDS_RESTORE, EXIT_DROPPED, EXIT_REJECTED)


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
        self.store: dist.TCPStore | None = None  # the store it hosts (None with an external one)
        self.store_client: StoreClient | None = None  # its client (standby keys), either way
        self.history: list[LaunchEvent] = []
        self.standbys: dict[Worker, list[tuple[str, subprocess.Popen[bytes]]]] = {}
        # pid -> (its log, accounting size at start, first start of the job: not a re-join/standby/resume)
        self._started: dict[int, tuple[Path, int, bool]] = {}
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

    @property
    def store_address(self) -> tuple[str, int]:
        """Where the workers reach the store (set by `start`)."""
        assert self.store_client is not None, "start() first"
        return self.store_client.addr

    def start(self) -> None:
        """Host the store (unless the spec names an external one), publish version 1 and start every
        worker."""
        self.spec.out_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.out_dir / "job.json").write_text(self.spec.job.model_dump_json())
        timeout = runtime_settings().group_timeout
        if self.spec.store is not None:  # reconnects when the store is restarted
            self.store_client = StoreClient(self.spec.store, timeout)
            try:
                self.store_client.connect()
            except StoreUnavailable as e:
                raise LaunchError(str(e)) from e
            self.publisher.start()
            for w in self.spec.workers():
                self._spawn(w, rejoin=False)
            return
        try:
            self.store = dist.TCPStore(
                "127.0.0.1",
                self.spec.store_port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=60),
            )
        except RuntimeError as e:  # e.g. --store-port taken since it was checked
            raise LaunchError(f"cannot host the store on 127.0.0.1:{self.spec.store_port}: {e}") from e
        self.store_client = StoreClient(("127.0.0.1", self.store.port), timeout, server=self.store)
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
        name = f"worker_{w[0]}_{w[1]}" + (
            "" if standby_key is None else f"_standby{standby_key.rsplit('.', 1)[1]}"
        )
        log = (self.spec.out_dir / f"{name}.log").open("ab")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
        env["LOCAL_RANK"] = str(self.spec.workers().index(w))  # --device cuda: cuda:<LOCAL_RANK % count>
        cmd = self.spec.command(
            w, self.store_address[1], rejoin, standby_key, fail_at, self.publisher.worker_args(), resume
        )
        acct = self.acct_path(w)
        offset = acct.stat().st_size if acct.exists() else 0
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        first = not rejoin and not resume and standby_key is None
        self._started[proc.pid] = (self.spec.out_dir / f"{name}.log", offset, first)
        if standby_key is None:
            self._set_proc(w, proc)
        return proc

    def acct_path(self, w: Worker) -> Path:
        """Worker `w`'s accounting file (JSON lines, appended by every process of `w`)."""
        return self.spec.out_dir / f"acct_{w[0]}_{w[1]}.jsonl"

    def _set_proc(self, w: Worker, proc: subprocess.Popen[bytes]) -> None:
        """`proc` is now worker `w`'s process; its pid goes to <out>/worker_<d>_<s>.pid."""
        self.procs[w] = proc
        (self.spec.out_dir / f"worker_{w[0]}_{w[1]}.pid").write_text(f"{proc.pid}\n")

    def _record(self, kind: str, w: Worker | None, **detail: object) -> None:
        now = time.monotonic()
        self.events.append((now, kind, w if w is not None else (-1, -1)))
        self.history.append(LaunchEvent(now, kind, w, self.version, **detail))  # type: ignore[arg-type]

    def add_standby(self, w: Worker, fail_at: tuple[int, str] | None = None) -> None:
        """Start a warm replacement for `w` now (import, store connection); `activate` makes it join.
        `fail_at` counts iterations from the one it joins at."""
        self.num_standbys += 1
        key = f"recycle/{self.spec.run_id}/activate/{w[0]}.{w[1]}.{self.num_standbys}"
        self.standbys.setdefault(w, []).append((key, self._spawn(w, True, key, fail_at)))

    def activate(self, w: Worker) -> None:
        """Bring failed worker `w` back from its next standby, under a new version."""
        assert self.store_client is not None and w in self.failed
        key, proc = self.standbys[w].pop(0)
        self.retired.append(self.procs[w])
        self._set_proc(w, proc)
        acct = self.acct_path(w)  # its steps are the ones appended from now on
        self._started[proc.pid] = (
            self._started[proc.pid][0],
            acct.stat().st_size if acct.exists() else 0,
            False,
        )
        self.failed.discard(w)
        self._record("rejoin", w)
        self.publisher.report("rejoin", [w], "warm standby activated")
        self.store_client.set(key, str(self.version))

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
                log, offset, first = self._started.get(p.pid, (self.spec.out_dir / "?", 0, False))
                it = last_step(self.acct_path(w), offset)
                # Only a first start can reveal bad configuration: a re-joiner, standby or resumed
                # worker ran the same configuration before, so its error is a failure like any other;
                # but exit 2 is bad input whenever it comes (e.g. --check-data found the data function
                # non-deterministic mid-run): re-routing would only move it to the next worker.
                startup = first and it is None and p.returncode > 0 and p.returncode not in PROTOCOL_EXITS
                if startup or p.returncode == 2:
                    self.terminate()
                    raise WorkerStartupError(w, p.returncode, log_error(log), log, at_start=it is None)
                self._record("died", w, iteration=None if it is None else it + 1, code=p.returncode)
                died.append(w)
                restore |= p.returncode == EXIT_NEEDS_RESTORE
        running = len(self.procs) - len(self.failed) - len(died) - len(self.finished)
        self.failed.update(died)
        if late_lost and running > 0:
            self.restore(f"stage(s) {late_lost} lost (late answer)")
            return died
        if not died or (running == 0 and not restore):
            return died
        lost = lost_stages(frozenset(self.failed), self.spec.job.num_pipelines, self.spec.job.num_stages)
        if self.report_failures and not restore:  # reported even when lost: the service records it
            reported = self.publisher.report("fail", died, "process exited").lost_stages
            lost = lost or reported
        if lost or restore:
            self.restore(
                f"stage(s) {lost} lost (all their workers failed)" if lost else "a worker saw needs_restore"
            )
        return died

    def restore(self, why: str) -> None:
        """Stop every worker, tell the publisher all are back, restart all D x P with --resume from the
        newest complete checkpoint (from scratch if none is complete yet). LaunchError when
        checkpointing is off or after `max_restores` restores."""
        self.restores += 1
        if self.spec.checkpoint_every <= 0:
            self.terminate()
            raise LaunchError(
                f"{why}: no checkpoint exists (checkpointing is off; --checkpoint-every N turns it on), "
                "so the job cannot go on"
            )
        if self.restores > self.max_restores:
            self.terminate()
            raise LaunchError(f"{why}: more than {self.max_restores} restores, giving up")
        k = checkpoint.latest_complete(self.spec.checkpoints, self.spec.job.num_stages)
        if k is None:
            logger.error("%s: no complete checkpoint yet: restarting every worker from iteration 0", why)
        else:
            logger.error("%s: restoring every worker from the checkpoint at iteration %d", why, k)
        self.terminate()
        self.retired.extend(self.procs.values())
        self.standbys.clear()
        self.failed.clear()
        self.finished.clear()
        self._record("restore", None, checkpoint=k, why=why)
        version = self.publisher.restored()
        logger.info("restore: schedule v%d, restarting %d workers", version, len(self.procs))
        for w in self.spec.workers():
            self._spawn(w, rejoin=False, resume=True)

    def kill(self, w: Worker) -> None:
        """SIGKILL a worker (fault injection from outside)."""
        self.procs[w].kill()

    def restart(self, w: Worker) -> None:
        """Start a failed worker again: it re-joins from a peer under the next version."""
        self.failed.discard(w)
        self._spawn(w, rejoin=True)
        self._record("rejoin", w)
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
