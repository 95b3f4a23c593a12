"""SIGTERM and SIGHUP stop a launcher or an agent (kill, Slurm, Kubernetes, a closed terminal): they
raise SystemExit(128 + signal) in the main thread, so that it stops every worker it started before it
exits (before, they trained on, orphaned). SIGINT (Ctrl-C) raises KeyboardInterrupt, as Python's own
handler does, under the same rule below.

Not anywhere, though. `subprocess.Popen.poll` takes the process's wait lock and only then enters its
`try`: an exception raised by a signal handler between the two leaves the lock held, and the next
`wait()` of that process (the clean-up's, right after) blocks for ever. The supervision loop polls
every worker every 20 ms, so a SIGTERM lands there now and then: a launcher killed [0, 0] and hung
(CI). `WorkerPopen` runs `poll` and `wait` `shielded()`: a stop signal that comes meanwhile is
raised as soon as the call is done.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_state: dict[str, int] = {"shielded": 0, "pending": 0}  # pending: a signal number, 0 none


def _stop(signum: int) -> BaseException:
    """What stop signal `signum` raises: KeyboardInterrupt for SIGINT, else SystemExit(128 + signum)."""
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _state["shielded"]:
        _state["pending"] = signum
        return
    raise _stop(signum)


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP raise SystemExit(128 + signal), SIGINT KeyboardInterrupt (outside
    `shielded` sections)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_signal)


@contextmanager
def shielded() -> Iterator[None]:
    """A section a stop signal must not interrupt: one that comes meanwhile is raised at its end."""
    _state["shielded"] += 1
    try:
        yield
    finally:
        _state["shielded"] -= 1
    if not _state["shielded"] and _state["pending"]:
        signum, _state["pending"] = _state["pending"], 0
        raise _stop(signum)


class WorkerPopen(subprocess.Popen[bytes]):
    """A worker process whose `poll` and `wait` a stop signal cannot leave with its wait lock held."""

    def poll(self) -> int | None:
        with shielded():
            return super().poll()

    def wait(self, timeout: float | None = None) -> int:
        with shielded():
            return super().wait(timeout)
