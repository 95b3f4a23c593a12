"""Supervising a set of local worker processes: the core of `recycle agent` (agent.py) and of
`recycle launch` (launch.py's Launcher extends it).

Unlike torchrun's agent, a dead worker does not take the others down. Each supervision tick (`poll`):

- reaps exited workers. Exit 0: finished. A first start that exits with an error before its first
  step, or exit 2 at any time, is a configuration error (WorkerStartupError; every worker is
  stopped). EXIT_NEEDS_RESTORE: the worker saw a lost stage and could not load in place; it is simply
  not running, and the next restore epoch restarts it. If it left with a `lost` record (its version
  needed state no live worker holds, e.g. a layer to migrate whose every holder died: the controller
  cannot know), the supervisor asks the publisher for a restore (`on_state_lost`); one that left a
  version older than the restore it already followed is restarted into that restore at once.
  EXIT_DROPPED: the schedule lists it failed although it lived (e.g. a healed partition): restarted
  as a fresh re-joiner and a `rejoin` reported, up to `max_rejoins` times per worker (unless
  `rejoin_dropped` is off); a process the supervisor ended because the service failed it counts the
  same (`_end_fenced`). Anything else is a death: reported at once as a `fail` event with the
  id `agent-<agent id>-fail-<d>.<s>-<pid>` (the same id on every retry through the publisher's
  outbox), and with `keep_standby` its warm standby is activated (a `rejoin`) and a new one started.
- follows restores: when the publisher shows a restore epoch above the last one followed (the
  FilePublisher publishes one itself when a failure loses a stage; the service does, and its
  publisher follows the job's versions), every local worker that is not running is restarted with
  `--resume-at K --restore-epoch N` (K: the restore's checkpoint, `none` without one); survivors load
  in place by themselves. Workers without `--resume-at` (before in-place restores existed) cannot:
  then every running worker is stopped and all restart with `--resume`.

Survivors are never killed because a peer died. Every death, re-join and restore goes to `history`
(summary.LaunchEvent). The processes themselves (spawn, standbys, re-joins, kill) are
supervisor_procs.py's `WorkerProcesses`, which Supervisor extends with this policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Self

from runtime_adapter.assignment import Worker
from runtime_adapter.launch_spec import LaunchSpec
from runtime_adapter.progress import last_step, log_error
from runtime_adapter.publishers import Publisher, Restore
from runtime_adapter.supervisor_errors import (
    PROTOCOL_EXITS,
    LaunchError,
    WorkerStartupError,
)
from runtime_adapter.supervisor_procs import WorkerProcesses
from runtime_adapter.worker_options import EXIT_DROPPED, EXIT_NEEDS_RESTORE

logger = logging.getLogger(__name__)


class Supervisor(WorkerProcesses):
    """Supervises the worker processes of `workers` (default: the whole job) on this machine."""

    def __init__(
        self,
        spec: LaunchSpec,
        publisher: Publisher,
        workers: list[Worker] | None = None,
        agent_id: str = "",
        report_failures: bool = True,
        rejoin_dropped: bool = True,
        max_rejoins: int = 3,
        keep_standby: bool = False,
        max_restores: int | None = None,
        restore_wait_s: float | None = None,
    ) -> None:
        """`report_failures=False` leaves deaths to the service's heartbeat timeout; `max_restores`
        and `restore_wait_s` (how long a lost stage may wait for its restore version): LaunchError
        beyond them (None: no limit)."""
        super().__init__(spec, publisher, workers, agent_id)
        self.report_failures, self.rejoin_dropped = report_failures, rejoin_dropped
        self.max_rejoins, self.keep_standby, self.max_restores = max_rejoins, keep_standby, max_restores
        self.restore_wait_s = restore_wait_s
        self.finished: set[Worker] = set()
        self.waiting: set[Worker] = set()  # exited EXIT_NEEDS_RESTORE: restarted by the next restore
        self.rejoins: dict[Worker, int] = {}
        self.epoch = 0  # the newest restore epoch followed
        self.restores = 0
        self.lost: list[int] = []  # stages a report found lost, until the restore comes
        self.restore_due: float | None = None  # since when a restore is expected (lost or waiting)
        self.state_lost: dict[Worker, tuple[int, str, int]] = {}  # left with a `lost` record: (version,
        # why, pid), until the restore is asked for
        self.lost_why = ""  # the state loss the next restore answers
        self.followed: Restore | None = None  # the newest restore followed
        self.fenced_pids: set[int] = set()  # processes _end_fenced ended: dropped, not dead

    def _end_fenced(self) -> None:
        """Kill the process of a worker the service declared failed while it still runs (hung, or
        stopped with SIGSTOP: no poll, no progress). Its peers go on without it; left running, it held
        `settled()` false for ever and the launch never ended. The next _reap takes it for dropped,
        as if it had seen the version that fails it and left (EXIT_DROPPED): it re-joins as a fresh
        worker (before, it counted as dead: a worker cut off by a partition whose agent saw the
        version first never re-joined). Only first starts: a re-joined or restored process may run
        before the version that takes it back in.

        With a schedule file the launcher is the heartbeat (Publisher.silent, heartbeats.py): a worker
        silent for the timeout is killed, and the next _reap reports its death as any other (before,
        it stayed alive, its peers timed out waiting on it and were the ones reported)."""
        running = {w: p.pid for w, p in self.procs.items() if w not in self.failed and p.poll() is None}
        for w in self.publisher.silent(running):
            logger.warning("worker %s: no schedule poll for the heartbeat timeout (stopped?); ending its "
                           "process", list(w))  # fmt: skip
            self.procs[w].kill()
            self.procs[w].wait()
        for w in self.publisher.fenced():
            p = self.procs.get(w)
            first = p is not None and self._started.get(p.pid, (None, 0, False))[2]
            if p is not None and first and p.poll() is None and w not in self.failed:
                logger.warning("worker %s: the service declared it failed; ending its process", list(w))
                p.kill()
                p.wait()
                self.fenced_pids.add(p.pid)

    def _reap(self) -> list[tuple[Worker, int]]:
        """Classify the exits since the last tick; the deaths (worker, exit code)."""
        died = []
        for w, p in list(self.procs.items()):
            if w in self.finished or w in self.failed or w in self.waiting or p.poll() is None:
                continue
            code = int(p.returncode)
            if code == 0:
                self.finished.add(w)
                continue
            if p.pid in self.fenced_pids:  # ended above: it lived, and the service dropped it
                code = EXIT_DROPPED
            log, offset, first = self._started.get(p.pid, (self.spec.out_dir / "?", 0, False))
            it = last_step(self.acct_path(w), offset)
            # Only a first start can reveal bad configuration: a re-joiner, standby or restored worker
            # ran the same configuration before, so its error is a failure like any other; but exit 2
            # is bad input whenever it comes (e.g. --check-data found the data function
            # non-deterministic mid-run): re-routing would only move it to the next worker.
            if (first and it is None and code > 0 and code not in PROTOCOL_EXITS) or code == 2:
                self.terminate()
                raise WorkerStartupError(w, code, log_error(log), log, at_start=it is None and code != 2)
            if code == EXIT_NEEDS_RESTORE:
                lost = self.lost_state(w, p.pid)
                if lost is not None and self.followed is not None and self.followed.version > lost[0]:
                    logger.warning("worker %s left v%d (%s): restarting it into restore epoch %d",
                                   list(w), lost[0], lost[1], self.followed.epoch)  # fmt: skip
                    self._spawn(w, restore=self.followed)
                    continue
                logger.warning("worker %s stopped for a restore (exit %d)%s", list(w), code,
                               "" if lost is None else f": v{lost[0]}: {lost[1]}")  # fmt: skip
                self.waiting.add(w)
                if lost is not None:
                    self.state_lost[w] = (lost[0], lost[1], p.pid)
                self.restore_due = self.restore_due or time.monotonic()
                continue
            logger.warning("worker %s exited with %s", list(w), code)
            self._record("died", w, iteration=None if it is None else it + 1, code=code)
            self.failed.add(w)
            died.append((w, code))
        return died

    def _new_restore(self) -> Restore | None:
        restore = self.publisher.latest_restore()
        return restore if restore is not None and restore.epoch > self.epoch else None

    def poll(self) -> list[Worker]:
        """One supervision tick (see the module docstring); the workers that died in it."""
        lost = set(self.publisher.flush())  # a queued event the service now answered as unrecoverable
        self._end_fenced()
        died = self._reap()
        for w, code in died:
            if self._new_restore() is not None:
                break  # the restore restarts the ones left: a fail now would drop them from it
            if code == EXIT_DROPPED:
                self._dropped(w)
                continue
            if self.report_failures:
                pid = self.procs[w].pid
                outcome = self.publisher.report("fail", [w], f"process exited with {code}",
                                                self.event_id("fail", w, pid))  # fmt: skip
                lost.update(outcome.lost_stages)
            if self.keep_standby and self.standbys.get(w) and not lost:
                self.activate(w)
                self.add_standby(w)
        if self.state_lost and self._new_restore() is None:
            lost.update(self._ask_restore())
        if lost:
            self.lost = sorted(lost | set(self.lost))
            self.restore_due = self.restore_due or time.monotonic()
        restore = self._new_restore()
        if restore is not None:
            self._follow(restore)
        elif lost:
            self.on_lost(self.lost)
        due, limit = self.restore_due, self.restore_wait_s
        if due is not None and limit is not None and time.monotonic() - due > limit:
            self.terminate()
            what = self.lost_why or (
                f"stage(s) {self.lost} lost" if self.lost else "a worker saw needs_restore"
            )
            raise LaunchError(f"{what}: no restore version was published within {limit:g} s")
        return [w for w, _ in died]

    def _dropped(self, w: Worker) -> None:
        """`w` lived but a version lists it failed: re-join as a fresh worker, within the limits."""
        n = self.rejoins.get(w, 0)
        if not self.rejoin_dropped or n >= self.max_rejoins:
            why = "re-joins are off" if not self.rejoin_dropped else f"it re-joined {n} times already"
            logger.error("worker %s was dropped by the schedule; not restarting it (%s)", list(w), why)
            return
        self.rejoins[w] = n + 1
        self.restart(w)

    def _ask_restore(self) -> list[int]:
        """Workers left with a `lost` record: ask for a restore (on_state_lost); the stages the
        publisher's answer names lost."""
        pending, self.state_lost = sorted(self.state_lost.items()), {}
        version, why, _ = pending[0][1]
        self.lost_why = f"v{version}: {why}"
        return self.on_state_lost(
            self.lost_why, [(w, self.event_id("fail", w, pid)) for w, (_, _, pid) in pending]
        )

    def on_state_lost(self, why: str, left: list[tuple[Worker, str]]) -> list[int]:
        """The job's state is lost (`why`; `left`: the workers that left for it, with the event_id of
        their exit): ask the publisher for a restore from the newest complete checkpoint (unless
        deaths are left to the service's heartbeats, which then declare them failed); the stages
        its answer names lost (the Launcher gives up instead without checkpoints)."""
        logger.error("%s: the job's state is lost; asking for a restore", why)
        if not self.report_failures:
            return []
        return self.publisher.restore_lost(left, why).lost_stages

    def on_lost(self, stages: list[int]) -> None:
        """A report found `stages` lost and no restore is published yet (the Launcher gives up when it
        has no checkpoints); the default waits for the restore."""
        logger.error("stage(s) %s lost: waiting for the restore version", stages)

    def check_restore(self, why: str) -> None:
        """Before following a restore: LaunchError past `max_restores` (the Launcher adds its own)."""
        if self.max_restores is not None and self.restores > self.max_restores:
            self.terminate()
            raise LaunchError(f"{why}: more than {self.max_restores} restores, giving up")

    def _follow(self, restore: Restore) -> None:
        """Restart every local worker that is not running in restore epoch `restore.epoch`."""
        if self.lost_why:
            why = self.lost_why
        elif self.lost:
            why = f"stage(s) {self.lost} lost (all their workers failed)"
        elif self.waiting:
            why = "a worker saw needs_restore"
        else:
            why = f"restore epoch {restore.epoch} published"
        self.epoch, self.lost, self.restore_due = restore.epoch, [], None
        self.followed, self.state_lost, self.lost_why = restore, {}, ""
        self.restores += 1
        self.check_restore(why)
        down = []
        for w in self.local:
            code = self.procs[w].poll() if w in self.procs else -1
            if code == 0 and w not in self.waiting:
                self.finished.add(w)
            elif code is not None and w not in self.finished:
                down.append(w)
        start = "scratch" if restore.iteration is None else f"iteration {restore.iteration}"
        logger.error("%s: restore epoch %d from %s, restarting %s", why, restore.epoch, start, down)
        # (the version before the restore's first: the newest one, the restore's, is already out)
        before = restore.version - 1 if restore.version > 0 else None
        self._record("restore", None, before, checkpoint=restore.iteration, why=why, restarted=tuple(down))
        for w in down:
            self.failed.discard(w)
            self.waiting.discard(w)
            self._spawn(w, restore=restore)

    def settled(self) -> bool:
        """Every process exited, every exit handled, and no restore is pending."""
        return (
            not self.waiting
            and not self.lost
            and all(p.poll() is not None for p in self.procs.values())
            and all(w in self.finished or w in self.failed for w in self.procs)
        )

    def wait(self, timeout: timedelta, on_tick: Callable[[Self], None] | None = None) -> dict[Worker, int]:
        """Supervise until settled; kill all and raise TimeoutError past `timeout`. The exit codes."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            self.poll()
            if on_tick is not None:
                on_tick(self)
            if self.settled():
                break
            if time.monotonic() > deadline:
                self.terminate()
                raise TimeoutError(f"job did not finish within {timeout}")
            time.sleep(0.02)
        self.publisher.finish()
        self.terminate()  # the standbys left
        return {w: int(p.returncode) for w, p in self.procs.items()}
