"""The worker loop's (worker.py) restore and fencing side: what ends the process under the restore
protocol (`leave_code`, from incarnation.py's verdict), and its stage checkpoints (checkpoint.py):

- writing: every `checkpoint_every` stepped iterations the lowest alive worker of the stage writes it
  (its peers hold bitwise-equal state, so one copy per stage suffices), asynchronously; once the write
  is durable, `on_durable(stepped)` reports it (from the writer's thread);
- loading into the live module and optimizer: `--resume` (the newest complete checkpoint),
  `--resume-at K`, and a restore version taken in place (incarnation.py decides when): its checkpoint,
  or the initial parameters (rebuilt from the Training's seed) and a fresh optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from runtime_adapter import checkpoint
from runtime_adapter.assignment import Assignment
from runtime_adapter.executor import Executor
from runtime_adapter.incarnation import Verdict
from runtime_adapter.migration import Migrator
from runtime_adapter.worker_options import EXIT_DROPPED, EXIT_NEEDS_RESTORE, WorkerOptions

logger = logging.getLogger(__name__)


def leave_code(verdict: Verdict, a: Assignment, joined: int | None) -> int | None:
    """The exit code when `verdict` on version `a` ends the process (logged; `joined`: the version this
    process joined at), else None (run, restore in place, or wait)."""
    if verdict is Verdict.NEEDS_RESTORE:
        logger.error("schedule v%d: the job needs a restore from a checkpoint: stopping", a.version)
        return EXIT_NEEDS_RESTORE
    if verdict is Verdict.DROPPED:
        logger.error("schedule v%d lists this worker as failed: leaving", a.version)
        return EXIT_DROPPED
    if verdict is Verdict.FENCED:
        logger.error(
            "schedule v%d lists this worker alive since v%s, but this process joined at v%s: it was "
            "declared failed and replaced meanwhile; leaving without taking part",
            a.version, a.joined_at, joined,
        )  # fmt: skip
        return EXIT_DROPPED
    return None


class StageCheckpoints:
    """The checkpoints of worker `opts.worker`'s stage in `opts.checkpoint_dir` (None: none)."""

    def __init__(
        self,
        opts: WorkerOptions,
        executor: Executor,
        log: Callable[[dict[str, Any]], None],
        on_durable: Callable[[int], None],
        migrator: Migrator | None = None,
    ) -> None:
        """`log` writes an accounting record; `on_durable(stepped)` is called once a write is durable;
        `migrator`: the layers the module holds (checkpoints hold the stage's own layers only)."""
        self.opts, self.executor, self._log, self.on_durable = opts, executor, log, on_durable
        self.migrator = migrator
        self.writer: checkpoint.Checkpointer | None = None  # created by the first save

    def resume_newest(self) -> int | None:
        """Load this stage's part of the newest complete checkpoint; its stepped count (None: none)."""
        root, stage = self.opts.checkpoint_dir, self.opts.worker[1]
        if root is None:
            return None
        k = checkpoint.latest_complete(root, self.opts.num_stages)
        if k is None:
            logger.warning("no complete checkpoint in %s: starting from scratch", root)
            return None
        self._home()
        self.executor.load_state(checkpoint.load_stage(root, stage, k), k)
        logger.info("resumed from the checkpoint at %d stepped iterations", k)
        self._log({"event": "resume", "stepped": k})
        return k

    def load(self, k: int) -> None:
        """Load this stage's checkpoint at stepped count `k` into the live module and optimizer."""
        root = self.opts.checkpoint_dir
        if root is None:
            raise ValueError(f"no checkpoint directory to load the checkpoint at {k} from")
        self._home()
        self.executor.load_state(checkpoint.load_stage(root, self.opts.worker[1], k), k)
        logger.info("loaded the checkpoint at %d stepped iterations", k)

    def load_restore(self, a: Assignment) -> bool:
        """Load `a`'s restore in place: its checkpoint (iteration None: the initial parameters, rebuilt
        from the Training's seed, and a fresh optimizer); False when this process cannot (no
        checkpoint directory)."""
        assert a.restore is not None
        k, ex = a.restore.iteration, self.executor
        if k is None:
            self._home()
            ex.reset_state(ex.runner.build().state_dict())
            logger.warning(
                "restore epoch %d (v%d): back to the initial parameters", a.restore.epoch, a.version
            )
        elif self.opts.checkpoint_dir is None:
            logger.error(
                "restore epoch %d needs the checkpoint at %d: no --checkpoint-dir", a.restore.epoch, k
            )
            return False
        else:
            self.load(k)
            logger.warning("restore epoch %d (v%d): loaded in place", a.restore.epoch, a.version)
        return True

    def maybe_save(self, a: Assignment) -> None:
        """After a step under version `a`: start this stage's checkpoint when it is due and this worker
        is the stage's lowest alive one (see the module docstring)."""
        every, root, ex = self.opts.checkpoint_every, self.opts.checkpoint_dir, self.executor
        if every <= 0 or root is None or ex.stepped % every or not a.stage_alive:
            return
        if a.stage_alive[0] != self.opts.worker:
            return
        if self.migrator is not None and self.migrator.moved(a):
            # Checkpoints hold each stage's own layers, and a complete one needs every stage at the same
            # count: while any stage holds others, no stage writes (an unmoved stage writing on would
            # prune, KEEP later, its part of the last complete checkpoint from before the move).
            logger.info("no checkpoint at %d: v%d moves layers between stages", ex.stepped, a.version)
            return
        if self.writer is None:
            self.writer = checkpoint.Checkpointer(root)
        # Copies the state and returns (waiting first for the previous write, if still running); the
        # write runs in the background. The record says the save started; `on_durable` says it is done.
        model, optim = ex.module.state_dict(), ex.optimizer.state_dict()
        self.writer.save(self.opts.worker[1], ex.stepped, model, optim, self.on_durable)
        self._log({"event": "checkpoint", "stepped": ex.stepped, "version": a.version})

    def _home(self) -> None:
        """Before a load: the module back on the stage's own layers (what checkpoints hold)."""
        if self.migrator is not None:
            self.migrator.reshape_home()

    def close(self) -> None:
        """Wait for the last write (and its report)."""
        if self.writer is not None:
            self.writer.close()
