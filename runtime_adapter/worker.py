"""The worker loop: follow schedule versions, recover from failures without restarting survivors.

On every new version (a failure, a re-join, a better plan) each alive worker:
1. connects that version's groups (fresh store prefix);
2. agrees with all alive workers on k = the minimum number of stepped iterations (a fresh re-joiner
   counts as infinite): stages step at most one iteration apart, so every survivor is at k or k+1;
3. rolls back to its pre-step state if it is at k+1 (the iteration in flight is then replayed whole:
   no micro-batch is lost, none is counted twice, since the batches are a function of the iteration);
4. if a stage has a fresh re-joiner, its lowest veteran peer broadcasts parameters and optimizer state;
5. lowers its new order and runs iterations k, k+1, ... until the target, then a final all-reduce
   (so that nobody leaves while a late failure could still need it to roll back); then it saves its
   parameters and tells the schedule source it is done (with the service: a `done` event, after which
   its silence is not a failure and the job turns `finished` once every alive worker is done).

Restores and fencing (incarnation.py): a version with a `restore` epoch above the process's own
makes it load that checkpoint (checkpoint.py; written by the lowest alive worker of each stage every
`checkpoint_every` stepped iterations and reported through `on_checkpoint`) into its live module and
optimizer, or re-initialise them, and then recover as above: survivors are not restarted. A
`needs_restore` version is waited out under restore policy "auto" (the restore version follows) and
ends the process with EXIT_NEEDS_RESTORE otherwise. A version listing this worker alive since another
version than the one it joined at (and no newer restore) ends it with EXIT_DROPPED, touching nothing.
A process restarted for a restore starts with `resume_at` (the checkpoint) and `restore_epoch`.
A version whose recovery needs state no live worker holds (a layer to migrate, or a stage whose alive
workers are all re-joiners: MigrationError) ends the process with EXIT_NEEDS_RESTORE and a `lost`
record: its launcher or agent asks for a restore.

The checkpoint side (writing, loading, restoring in place) is worker_restore.py; the options, exit
codes, fault injection and log prefix are worker_options.py (their names stay importable from here).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import InvalidInputError
from runtime_adapter import store
from runtime_adapter.accounting import Accounting, acct_path
from runtime_adapter.assignment import Assignment
from runtime_adapter.client import ScheduleClient, ScheduleSource, SourceRejected
from runtime_adapter.comm import (
    GroupReaper,
    Groups,
    Interrupted,
    allreduce_min,
    broadcast_bytes,
)
from runtime_adapter.devices import activate, resolve_device, wire_device
from runtime_adapter.entry import load_entry
from runtime_adapter.executor import Executor
from runtime_adapter.incarnation import Incarnation, Verdict
from runtime_adapter.migration import Migrator
from runtime_adapter.migration_plan import MigrationError
from runtime_adapter.rendezvous import connect_groups
from runtime_adapter.settings import runtime_settings
from runtime_adapter.stage import StageRunner, check_training, data_digest
from runtime_adapter.stall import StallWatch
from runtime_adapter.worker_options import (
    EXIT_DROPPED,
    EXIT_NEEDS_RESTORE,
    EXIT_REJECTED,
    LOG_CONTEXT,
    WorkerOptions,
    fault_hook,
    install_log_prefix,
)
from runtime_adapter.worker_restore import StageCheckpoints, leave_code

logger = logging.getLogger(__name__)

FRESH = 1 << 40

__all__ = [
    "EXIT_DROPPED",
    "EXIT_NEEDS_RESTORE",
    "EXIT_REJECTED",
    "LOG_CONTEXT",
    "WorkerOptions",
    "WorkerProcess",
    "fault_hook",
    "install_log_prefix",
]


class WaitTimeout(TimeoutError):
    """No schedule version (RECYCLE_VERSION_WAIT_S) or standby call (RECYCLE_STANDBY_WAIT_S) in time:
    `recycle worker` ends with one line and exit 1."""


class WorkerProcess:
    """State of one worker process across schedule versions."""

    def __init__(self, opts: WorkerOptions, source: ScheduleSource) -> None:
        self.opts = opts
        self.settings = runtime_settings()  # the waits: RECYCLE_VERSION_WAIT_S, ...
        training = load_entry(opts.entry, opts.model)
        device = resolve_device(opts.device)
        activate(device)
        self.wire = wire_device(opts.backend, device)
        shapes = check_training(training, opts.num_stages, opts.num_pipelines, opts.num_microbatches)
        self.data_digest = data_digest(training, opts.num_pipelines, opts.num_microbatches)
        runner = StageRunner(training, opts.worker[1], opts.num_stages, device, shapes, opts.check_data)
        module = runner.build()
        logger.info("stage %d of %s on %s (wire: %s)", opts.worker[1], opts.entry, device, self.wire)
        self.executor = Executor(
            module,
            runner,
            opts.worker,
            opts.num_pipelines,
            opts.num_microbatches,
            fault_hook(opts.fail_at),
            before_step=lambda rec: self.acct.stepping(rec),
            stall=StallWatch(self.settings.stall_timeout),
        )
        self.client = ScheduleClient(
            source,
            on_new=lambda a: self.executor.interrupt(a.version),
            on_error=lambda _: self.executor.interrupt(FRESH),
        )
        self.fresh = opts.rejoin
        self.incarnation = Incarnation(epoch=opts.restore_epoch)
        self.acct = Accounting(acct_path(opts.out_dir, opts.worker), runner.is_last)
        self.reaper = GroupReaper()
        self.groups: list[Groups] = []  # built and not yet retired, oldest first
        # A stage checkpoint at this stepped count is durable (called by the writer, from any thread):
        # the source is told without blocking (the service: a `checkpoint` event with the worker token;
        # a schedule file: nothing, the launcher reads the directory). A fenced process tells nothing.
        self.on_checkpoint: Callable[[int], None] = self._report_checkpoint
        self.migrator = Migrator(self.executor, opts.num_stages)  # layers moved by a `partition`
        self.checkpoints = StageCheckpoints(
            opts, self.executor, self._log, lambda k: self.on_checkpoint(k), self.migrator
        )

    def _report_checkpoint(self, stepped: int) -> None:
        if not self.incarnation.fenced:
            self.client.report_checkpoint(stepped)

    def _log(self, record: dict[str, Any]) -> None:
        self.acct.write(record)

    def run(self) -> int:
        """Train until `num_iterations` are stepped by every alive worker; the process exit code
        (0 done, EXIT_NEEDS_RESTORE, EXIT_DROPPED, EXIT_REJECTED)."""
        try:
            return self._run()
        except SourceRejected as e:
            logger.error("stopping: %s", e)
            return EXIT_REJECTED
        finally:
            self.client.stop()

    def _run(self) -> int:
        version = 0
        if self.opts.resume:
            self.checkpoints.resume_newest()
        elif self.opts.resume_at is not None:
            self.checkpoints.load(self.opts.resume_at)
            self._log({"event": "resume", "stepped": self.opts.resume_at, "epoch": self.incarnation.epoch})
        if self.opts.standby_key is not None:
            version = self._wait_standby() - 1
        self.client.start()
        while True:
            a = self.client.wait_newer(version, self.settings.version_wait)
            if a is None:
                raise WaitTimeout(
                    f"no schedule version above {version} within {self.settings.version_wait_s:g} s "
                    f"(RECYCLE_VERSION_WAIT_S){self.client.unreachable_note()}"
                )
            version = LOG_CONTEXT["v"] = a.version
            verdict = self.incarnation.judge(a, self.fresh)
            if verdict is Verdict.WAIT:
                if a.state == "needs_restore":
                    logger.warning(
                        "schedule v%d: a stage is lost; waiting for the restore version", a.version
                    )
                continue  # (a re-joiner waits for the version that includes it)
            code = leave_code(verdict, a, self.incarnation.joined)
            if code is not None:
                return code
            if verdict is Verdict.RESTORE and not self._restore_in_place(a):
                return EXIT_NEEDS_RESTORE
            self.incarnation.took_part(a)
            try:
                self._recover(a)
                self._train(a)
                break
            except Interrupted as e:
                logger.info("v%d: %s", a.version, e)
            except MigrationError as e:  # a layer (or a stage's state) without a live holder
                return self._lost(a, e)
            except (RuntimeError, dist.DistError) as e:
                logger.warning("v%d: communication failed (%s); waiting for a new version", a.version, e)
        self._save()
        self.client.done()  # stop polling; the service must not take the silence for a failure
        return 0

    def _lost(self, a: Assignment, e: MigrationError) -> int:
        """Version `a` needs state that no live worker holds (every worker of `a` finds the same): the
        job's state is lost. Leave as for a restore (EXIT_NEEDS_RESTORE), with a `lost` record that
        tells the launcher or agent why (it asks the controller for a restore from the newest complete
        checkpoint, from before any move: docs/runtime.md "Layer migration")."""
        logger.error(
            "v%d: %s: the job's state is lost; leaving for a restore from a checkpoint", a.version, e
        )
        self._log({"event": "lost", "version": a.version, "why": str(e)})
        self.checkpoints.close()
        self.acct.close()
        return EXIT_NEEDS_RESTORE

    def _restore_in_place(self, a: Assignment) -> bool:
        """Take `a`'s restore without a restart (StageCheckpoints.load_restore), then belong to its
        epoch; False when this process cannot (no checkpoint directory)."""
        assert a.restore is not None
        if not self.checkpoints.load_restore(a):
            return False
        self.incarnation.restored(a)
        self.fresh = False
        k = a.restore.iteration
        record = {"event": "resume", "stepped": k or 0, "epoch": a.restore.epoch, "version": a.version}
        self._log({**record, "in_place": True})
        return True

    def _wait_standby(self) -> int:
        """A warm standby: wait until the launcher sets the standby key (the version to join); the
        store may die and restart meanwhile (the key is then set on the new one): reconnect."""
        key, addr = self.opts.standby_key, (self.opts.store_host, self.opts.store_port)
        assert key is not None
        logger.info("standby: waiting for %s", key)
        deadline = time.monotonic() + self.settings.standby_wait.total_seconds()
        while True:
            client = store.connect(addr, self.settings.group_timeout, deadline)
            try:
                client.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                return int(client.get(key))
            except RuntimeError as e:  # the store went away (or the wait timed out: then give up)
                if time.monotonic() >= deadline:
                    raise WaitTimeout(
                        f"standby: {key} not set within {self.settings.standby_wait_s:g} s "
                        "(RECYCLE_STANDBY_WAIT_S)"
                    ) from e
                logger.warning("standby: the store went away (%s); reconnecting", str(e).splitlines()[0])
                time.sleep(0.1)

    def _recover(self, a: Assignment) -> None:
        ex = self.executor
        ex.begin_version(a.version)
        groups = self._connect(a)
        self.groups.append(groups)
        mine = FRESH if self.fresh else ex.stepped
        h = self.data_digest
        k, settled, low, minus_high = allreduce_min(
            groups, [mine, int(self.migrator.settled(a, self.fresh)), h, -h]
        )
        if low != -minus_high:  # every alive worker sees it: all leave with the same one line, exit 2
            raise InvalidInputError(
                f"v{a.version}: the alive workers' data functions disagree (their digests of the start-up "
                "sample micro-batches differ): data must be the same pure function of (iteration, pipeline, "
                "microbatch) in every process (no unseeded shuffle or draw at load time; the same code and "
                "files on every host)"
            )
        if not self.fresh and ex.stepped != k:
            ex.rollback_to(k)
            self._log({"event": "rollback", "to": k, "version": a.version})
        for record in self.migrator.follow(a, groups, self.fresh, bool(settled)):  # layers moved
            self._log(record)
        # state transfer on the stage group: source = lowest-ranked veteran, if anyone is fresh
        rank = groups.stage_rank[a.worker]
        src, not_fresh = allreduce_min(groups, [FRESH if self.fresh else rank, 0 if self.fresh else 1], True)
        if src >= FRESH:  # its state is lost (seen by the stage's workers; the rest by the restore)
            raise MigrationError(f"stage {a.worker[1]}: no live worker holds its state (only re-joiners)")
        if not_fresh == 0:
            data = broadcast_bytes(groups, ex.state_bytes() if rank == src else None, src)
            if self.fresh:
                ex.load_state_bytes(data, k)
                logger.info("re-joined: state copied from stage rank %d at %d stepped iterations", src, k)
                self._log({"event": "rejoin", "stepped": k, "version": a.version})
            self.fresh = False
        ex.apply(a, groups)
        self._retire_older(groups)
        self._log({"event": "version", "version": a.version, "from": k, **self._resources()})
        latest = self.client.latest()
        if latest is not None and latest.version > a.version:
            raise Interrupted(f"v{latest.version} arrived during recovery")
        logger.info("running v%d from iteration %d", a.version, k)

    def _retire_older(self, current: Groups) -> None:
        """Destroy the groups of every older version: each alive worker of `current` has left them
        (it took part in this version's agreement), and the others are dead or dropped."""
        for old in [g for g in self.groups if g is not current]:
            self.reaper.retire(old)
        self.groups = [current]

    def _resources(self) -> dict[str, int]:
        """Live process groups and OS threads of this process (bounded across versions)."""
        try:
            threads = len(os.listdir("/proc/self/task"))
        except OSError:
            threads = threading.active_count()
        return {"groups": self.reaper.live(), "threads": threads}

    def _connect(self, a: Assignment) -> Groups:
        """Version `a`'s groups; Interrupted when a newer version arrives first."""

        def superseded() -> bool:
            latest = self.client.latest()
            return self.executor.interrupted.is_set() or (latest is not None and latest.version > a.version)

        o = self.opts
        return connect_groups(
            (o.store_host, o.store_port),
            a,
            self.executor.interrupted,
            o.backend,
            self.settings.group_timeout,
            self.reaper,
            superseded,
            device=self.wire,
            run=o.run_id,
            # a member may come late (a re-joiner still starting, slower than the group timeout):
            # start new attempts for as long as the worker would wait for a new version
            patience=max(self.settings.version_wait, self.settings.group_timeout),
        )

    def _train(self, a: Assignment) -> None:
        ex = self.executor
        while ex.stepped < self.opts.num_iterations:
            LOG_CONTEXT["it"] = ex.stepped
            t0 = time.monotonic()
            rec = ex.run_iteration(ex.stepped)
            # The record right after the step ("stepping" was written before the all-reduce): a kill
            # during the checkpoint or the pause below must not leave a step unconfirmed.
            self.acct.step(rec)
            self.checkpoints.maybe_save(a)
            pause = self.opts.pace_ms / 1e3 - (time.monotonic() - t0)
            if pause > 0:
                time.sleep(pause)
        assert ex.groups is not None
        done = allreduce_min(ex.groups, [ex.stepped])[0]
        if done < self.opts.num_iterations:
            raise RuntimeError(f"final check: some worker has only {done} stepped iterations")

    def _save(self) -> None:
        d, s = self.opts.worker
        self.checkpoints.close()  # the last checkpoint's write (and its report) before leaving
        torch.save(self.executor.module.state_dict(), self.opts.out_dir / f"final_{d}_{s}.pt")
        self.reaper.drain(self.settings.group_timeout.total_seconds())
        where = self.migrator.where()
        self._log({"event": "done", "stepped": self.executor.stepped, **where, **self._resources()})
        self.acct.close()
