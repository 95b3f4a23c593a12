"""Heartbeat files: how a launch with a schedule file (`recycle launch --schedules`) tells a stopped
worker from a dead one without a service.

With a service, a worker's schedule polls are its heartbeat and the service fails a silent worker
(docs/service.md). A schedule file has no one to poll, so a worker started with `--heartbeat-dir DIR`
touches `DIR/<d>_<s>.<pid>` from its schedule-polling thread (at most every HEARTBEAT_EVERY_S), and
removes it once it reported `done`. The launcher (FilePublisher.silent) takes a running worker whose
file is older than the heartbeat timeout for stopped (SIGSTOP, a frozen process): it ends the
process, and the death is handled as any other (re-routed). Before, such a worker stayed "alive":
its peers timed out on it and were the ones taken for failed.

A worker is not tracked before its first poll (no file yet: starting, importing torch) nor after
`done`; the pid in the name keeps a restarted worker's process from being judged by its
predecessor's file. The times are file modification times (the same machine's clock).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from runtime_adapter.assignment import Worker

logger = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 0.5  # how often a worker touches its file (it polls the schedule every 20 ms)
DEFAULT_TIMEOUT_S = 30.0  # the launcher's default silence before it ends a worker (as the service's)


def heartbeat_path(directory: Path, worker: Worker, pid: int) -> Path:
    """The heartbeat file of `worker`'s process `pid`."""
    return Path(directory) / f"{worker[0]}_{worker[1]}.{pid}"


class Heartbeat:
    """This process's heartbeat file, touched by `beat` at most every HEARTBEAT_EVERY_S."""

    def __init__(self, directory: Path, worker: Worker) -> None:
        self.path = heartbeat_path(directory, worker, os.getpid())
        self._last = float("-inf")
        self._warned = False

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._last < HEARTBEAT_EVERY_S:
            return
        self._last = now
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        except OSError as e:  # the launcher then cannot tell this worker stopped; training goes on
            if not self._warned:
                logger.warning("heartbeat file %s: %s", self.path, e)
                self._warned = True

    def end(self) -> None:
        """The worker is done: no longer tracked."""
        self.path.unlink(missing_ok=True)


class Watch:
    """The launcher's side: `silent` between calls, unless the launcher itself stalled."""

    def __init__(self, directory: Path, timeout_s: float) -> None:
        self.directory, self.timeout_s = Path(directory), timeout_s
        self._last: float | None = None

    def silent(self, running: Mapping[Worker, int]) -> list[Worker]:
        """`silent(...)`, but none right after a gap of more than half the timeout since the last
        call: the launcher did not run meanwhile (the machine was suspended, the process stopped),
        and neither did its workers, whose files are as old as that gap; they beat again within
        HEARTBEAT_EVERY_S."""
        now = time.time()
        gap = 0.0 if self._last is None else now - self._last
        self._last = now
        if gap > self.timeout_s / 2:
            logger.warning("the launcher did not run for %.1f s: heartbeats not judged this time", gap)
            return []
        return silent(self.directory, running, self.timeout_s, now)


def silent(
    directory: Path, running: Mapping[Worker, int], timeout_s: float, now: float | None = None
) -> list[Worker]:
    """The workers of `running` (worker -> pid of its running process) whose heartbeat file is older
    than `timeout_s` at `now` (default: the wall clock's now); a worker without a file is not tracked."""
    now = time.time() if now is None else now
    out = []
    for w, pid in running.items():
        try:
            beat = heartbeat_path(directory, w, pid).stat().st_mtime
        except FileNotFoundError:
            continue
        if now - beat > timeout_s:
            out.append(w)
    return sorted(out)
