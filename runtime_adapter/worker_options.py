"""What one worker process is given (`WorkerOptions`, from `recycle worker`'s flags), its exit codes (the
supervisor reads them), and two process-wide helpers: the fault injection hook (`--fail-at`) and the
log prefix (`[d,s v=<version> it=<iteration>]`, kept current by the worker loop in LOG_CONTEXT).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime_adapter.assignment import Worker
from runtime_adapter.entry import DEFAULT_ENTRY

if TYPE_CHECKING:
    from runtime_adapter.lowering import Instr

logger = logging.getLogger(__name__)

LOG_CONTEXT: dict[str, int] = {"v": 0, "it": 0}

EXIT_NEEDS_RESTORE = 3  # the job lost a whole stage: restart every worker from a checkpoint
EXIT_DROPPED = 4  # the schedule lists this (alive) worker as failed
EXIT_REJECTED = 5  # the schedule source refused this worker (401/403/404): retrying cannot help


@dataclass
class WorkerOptions:
    """Everything one worker process needs."""

    worker: Worker
    num_pipelines: int
    num_stages: int
    num_microbatches: int
    num_iterations: int
    model: dict[str, Any]  # the entry point's keyword arguments
    store_host: str
    store_port: int
    out_dir: Path
    backend: str = "gloo"
    entry: str = DEFAULT_ENTRY  # package.module:function returning the Training
    device: str = "cpu"  # cpu, cuda, cuda:N (devices.resolve_device)
    check_data: bool = False  # read every micro-batch twice and compare
    run_id: str = ""  # store keys live under recycle/<run_id>/: runs sharing a store never meet
    rejoin: bool = False
    fail_at: tuple[int, str] | None = None
    standby_key: str | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # stepped iterations between checkpoints; 0: none
    resume: bool = False  # start from the newest complete checkpoint in checkpoint_dir
    resume_at: int | None = None  # start from exactly this checkpoint (None: the initial parameters)
    restore_epoch: int = 0  # the restore epoch this process starts in (it does not reload for it)
    pace_ms: float = 0.0  # sleep so that an iteration takes at least this long (tests, demos)


def fault_hook(fail_at: tuple[int, str] | None) -> Any:
    """A hook that kills this process (SIGKILL, no clean-up) before the first `phase` instruction of
    its `it`-th iteration, counted from the first iteration this process runs (a re-joiner's start);
    phase is F, B, W, BW, OPT (right before the gradient all-reduce) or REDUCED (right after it: the
    peers step, this worker dies before its `step` record; with global-norm clipping the peers then
    wait for its norm and nobody steps) or MIGRATE (a layer migration is planned, no tensor has moved
    yet: see migration.py)."""
    if fail_at is None:
        return None
    it, phase = fail_at
    first: list[int] = []

    def hook(iteration: int, ins: Instr) -> None:
        if not first:
            first.append(iteration)
        if iteration - first[0] == it and ins.kind == phase:
            logger.warning("fault injection: SIGKILL at iteration %d before %s", iteration, ins)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def install_log_prefix(worker: Worker) -> Callable[[], None]:
    """Prefix every log line of this process with `[d,s v=<version> it=<iteration>]` (once per record,
    whichever handlers see it); returns the function that takes the prefix off again (for a caller
    that goes on in this process: `recycle worker` run in-process on bad input)."""

    class _Prefix(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if not getattr(record, "recycle_prefixed", False):
                record.msg = (
                    f"[{worker[0]},{worker[1]} v={LOG_CONTEXT['v']} it={LOG_CONTEXT['it']}] {record.msg}"
                )
                record.recycle_prefixed = True
            return True

    prefix, handlers = _Prefix(), list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(prefix)

    def remove() -> None:
        for handler in handlers:
            handler.removeFilter(prefix)

    return remove
