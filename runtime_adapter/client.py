"""Schedule client: long-polls a schedule source (sources.py: a schedule file or the service) in a
background thread and hands new versions to the worker.

While the source is unreachable the client backs off (exponential, full jitter: backoff.py) and the
worker keeps running the last schedule it has; a source that refuses the worker for good
(SourceRejected) ends the polling. Checkpoint reports and the final `done` go to the source through
reports.py: a worker that completed its iterations calls `done()`: polling stops and the service is
told (a `done` event), so the worker's silence is not a failure.

The sources' names (FileScheduleSource, HttpScheduleSource, ScheduleSource, SourceRejected,
SourceUnavailable) stay importable from here.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from runtime_adapter.assignment import Assignment
from runtime_adapter.backoff import Backoff
from runtime_adapter.reports import BASE_BACKOFF_S, DONE_DEADLINE_S, CheckpointReports
from runtime_adapter.settings import runtime_settings
from runtime_adapter.sources import (
    WAIT_HEADER,
    FileScheduleSource,
    HttpScheduleSource,
    ScheduleSource,
    SourceRejected,
    SourceUnavailable,
)

logger = logging.getLogger(__name__)

__all__ = [
    "BASE_BACKOFF_S",
    "DONE_DEADLINE_S",
    "WAIT_HEADER",
    "FileScheduleSource",
    "HttpScheduleSource",
    "ScheduleClient",
    "ScheduleSource",
    "SourceRejected",
    "SourceUnavailable",
]


class ScheduleClient:
    """Background long-poll loop; `latest()` / `wait_newer()` for the worker, `on_new` for interrupts."""

    def __init__(
        self,
        source: ScheduleSource,
        on_new: Callable[[Assignment], None] | None = None,
        on_error: Callable[[SourceRejected], None] | None = None,
        poll_wait: timedelta | None = None,
        max_backoff: timedelta | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.source, self.on_new, self.on_error = source, on_new, on_error
        self.error: SourceRejected | None = None
        settings = runtime_settings()  # RECYCLE_POLL_WAIT_S, RECYCLE_MAX_BACKOFF_S unless given
        self.poll_wait = settings.poll_wait if poll_wait is None else poll_wait
        self.max_backoff = settings.max_backoff if max_backoff is None else max_backoff
        self.rng = rng
        self._latest: Assignment | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.unreachable_since: float | None = None
        self.last_unavailable = ""  # the source's last SourceUnavailable
        self._thread = threading.Thread(target=self._loop, name="recycle-client", daemon=True)
        self._reports = CheckpointReports(getattr(source, "checkpoint", None))

    def start(self) -> ScheduleClient:
        """Start polling."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (after the poll in flight)."""
        self._stop.set()

    def done(self) -> bool:
        """The worker completed its iterations: stop polling, deliver the checkpoint reports still
        queued, and tell the source (the service then does not take the worker's silence for a
        failure); True when the source took it."""
        self.stop()
        self.flush_reports()
        tell = getattr(self.source, "done", None)
        return True if tell is None else bool(tell())

    def report_checkpoint(self, iteration: int) -> None:
        """This worker's stage has a durable checkpoint at stepped count `iteration`: tell the source
        (the service: a `checkpoint` event) from a thread of its own (reports.CheckpointReports), so
        that neither the training loop nor the checkpoint writer waits for the network. Reports go out
        in order, each retried until its deadline."""
        self._reports.put(iteration)

    def flush_reports(self, timeout_s: float = DONE_DEADLINE_S) -> None:
        """Wait (up to `timeout_s`) until every queued checkpoint report was delivered or given up."""
        self._reports.flush(timeout_s)

    def latest(self) -> Assignment | None:
        """The newest assignment seen so far."""
        with self._cond:
            return self._latest

    def poll(self) -> Assignment | None:
        """Alias of latest(): the verb the worker loop uses at safe points."""
        return self.latest()

    def unreachable_note(self) -> str:
        """'; the schedule source is unreachable: <its last error>', or '' while it answers."""
        if self.unreachable_since is None:
            return ""
        return f"; the schedule source is unreachable: {self.last_unavailable}"

    def wait_newer(self, version: int, timeout: timedelta) -> Assignment | None:
        """The newest assignment once its version is above `version`, or None after `timeout`.
        Raises SourceRejected once the source has refused this worker."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while self._latest is None or self._latest.version <= version:
                if self.error is not None:
                    raise self.error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._latest

    def _loop(self) -> None:
        try:
            self._poll_until_stopped()
        finally:
            close = getattr(self.source, "close", None)
            if close is not None:
                close()

    def _poll_until_stopped(self) -> None:
        backoff = Backoff(BASE_BACKOFF_S, self.max_backoff.total_seconds(), self.rng)
        while not self._stop.is_set():
            current = self._latest.version if self._latest is not None else 0
            try:
                got = self.source.fetch(current, self.poll_wait)
            except SourceRejected as e:
                logger.error("schedule source refused this worker, stopping: %s", e)
                with self._cond:
                    self.error = e
                    self._cond.notify_all()
                if self.on_error is not None:
                    self.on_error(e)
                return
            except SourceUnavailable as e:
                self.last_unavailable = str(e)
                if self.unreachable_since is None:
                    self.unreachable_since = time.monotonic()
                    logger.warning("schedule source unreachable, keeping version %d: %s", current, e)
                self._stop.wait(backoff.next())
                continue
            if self.unreachable_since is not None:
                logger.info("schedule source reachable again")
                self.unreachable_since = None
            backoff.reset()
            if got is None or got.version <= current:
                continue
            with self._cond:
                self._latest = got
                self._cond.notify_all()
            logger.info(
                "schedule v%d received (state %s, failed %s)", got.version, got.state, sorted(got.failed)
            )
            if self.on_new is not None:
                self.on_new(got)
