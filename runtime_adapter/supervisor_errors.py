"""The supervisor's errors and what it needs to know about the worker command (supervisor.py)."""

from __future__ import annotations

from pathlib import Path

from runtime_adapter.assignment import Worker
from runtime_adapter.worker_options import EXIT_DROPPED, EXIT_NEEDS_RESTORE, EXIT_REJECTED

PROTOCOL_EXITS = (EXIT_NEEDS_RESTORE, EXIT_DROPPED, EXIT_REJECTED)


class LaunchError(RuntimeError):
    """The job cannot go on here (a stage lost without a checkpoint, too many restores)."""


class WorkerStartupError(LaunchError):
    """A worker exited with an error before its first step, or with exit 2 (bad input) at any time: a
    configuration error."""

    def __init__(self, worker: Worker, code: int, message: str, log: Path, at_start: bool = True) -> None:
        self.worker, self.code, self.log = worker, code, log
        when = "during start-up" if at_start else "with bad input"
        super().__init__(
            f"worker {list(worker)} stopped {when} with exit code {code}: {message} (log: {log})"
        )
