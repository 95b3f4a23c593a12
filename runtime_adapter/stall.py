"""A watchdog for the training thread: a compute op that never returns ends the worker.

A worker whose training thread hangs in its own computation (a deadlocked data loader, a user model
that waits for ever) keeps its polling thread alive: its heartbeats go on, nobody fails it, and its
peers wait on its activations until their collectives time out (`RECYCLE_GROUP_TIMEOUT_S`) and then
for a version that never comes: the whole job stalls. So the executor marks every compute op (F, B,
W, BW: the model and the data function; not the waits on peers, which end with the group timeout or
a new version) `busy`, and a daemon thread ends the process with EXIT_STALLED once one has run for
longer than the stall timeout (`RECYCLE_STALL_TIMEOUT_S`, default the group timeout: by then the
peers waiting on its result give up anyway). Its launcher or agent then reports it failed like any
dead worker, and the survivors re-route without it.

Time the whole process did not run (SIGSTOP, a suspended machine: the watchdog's own sleep overran by
over PAUSE_S) is not counted. On a GPU the host only launches kernels inside these ops; a kernel that
hangs is seen in the next wait instead (NCCL's own timeout), so what this catches is host-side: data,
Python, a deadlock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

EXIT_STALLED = 6  # a compute op ran longer than the stall timeout: the training thread hangs
PAUSE_S = 1.0  # the watchdog's sleep overran by more: the process was stopped, that time is not counted


def end_stalled(what: str, seconds: float, timeout_s: float) -> None:
    """Say why, flush the logs and end this process at once (the training thread cannot be stopped)."""
    logger.critical(
        "the training thread has been in %s for %.1f s (stall timeout %g s, RECYCLE_STALL_TIMEOUT_S): "
        "ending this worker so that its peers go on without it",
        what,
        seconds,
        timeout_s,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_STALLED)


class StallWatch:
    """Marks compute sections (`busy`) and ends the process when one outlasts `timeout_s`."""

    def __init__(self, timeout_s: float, on_stall: Callable[[str, float, float], None] = end_stalled) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the stall timeout must be > 0 s, not {timeout_s!r}")
        self.timeout_s, self.on_stall = timeout_s, on_stall
        self._what: str | None = None
        self._since = 0.0
        self._thread = threading.Thread(target=self._loop, name="recycle-stall", daemon=True)
        self._thread.start()

    @contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """A compute section of the training thread, named `what` in the log if it hangs."""
        self._since = time.monotonic()
        self._what = what
        try:
            yield
        finally:
            self._what = None

    def _loop(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        last, counted, paused = time.monotonic(), 0.0, 0.0
        while True:
            time.sleep(period)
            now = time.monotonic()
            gap, last = now - last - period, now
            what = self._what  # (read before `_since`: a section that began meanwhile looks younger)
            since = self._since
            if since != counted:
                counted, paused = since, 0.0
            if gap > PAUSE_S:  # this process did not run (stopped, suspended): not the op's time
                paused += gap
            ran = now - since - paused
            if what is not None and ran > self.timeout_s:
                self.on_stall(what, ran, self.timeout_s)
                return
