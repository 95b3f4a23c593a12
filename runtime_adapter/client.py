"""Schedule client: long-polls a schedule source and hands new versions to the worker.

Two sources behind one small interface: the service (GET /v1/jobs/{id}/schedule?worker=d,s with
after_version, wait, Bearer token, ETag / If-None-Match) and a schedule file holding the same envelope
({"version": N, "schedule": {...}}). While the source is unreachable the client backs off and the
worker keeps running the last schedule it has.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from planner.contract import Schedule
from runtime_adapter.assignment import Assignment, Worker, assignment_from_schedule, assignment_from_view

logger = logging.getLogger(__name__)

POLL_WAIT = timedelta(seconds=float(os.environ.get("RECYCLE_POLL_WAIT_S", "30")))
MAX_BACKOFF = timedelta(seconds=float(os.environ.get("RECYCLE_MAX_BACKOFF_S", "2")))


class SourceUnavailable(Exception):
    """The schedule source cannot be reached or answered garbage (retried with backoff)."""


class SourceRejected(Exception):
    """The source refused this worker for good (HTTP 401, 403, 404, other 4xx): retrying cannot help."""


class ScheduleSource(Protocol):
    """Where schedule versions come from."""

    def fetch(self, after_version: int, wait: timedelta) -> Assignment | None:
        """This worker's assignment in the first version above `after_version`, or None after `wait`."""
        ...


class FileScheduleSource:
    """A JSON file with {"version": N, "schedule": <CONTRACT.md schedule>}, replaced atomically."""

    def __init__(
        self, path: Path, worker: Worker, num_pipelines: int, num_microbatches: int, poll_s: float = 0.02
    ) -> None:
        self.path, self.worker, self.poll_s = Path(path), worker, poll_s
        self.num_pipelines, self.num_microbatches = num_pipelines, num_microbatches

    def fetch(self, after_version: int, wait: timedelta) -> Assignment | None:
        """See ScheduleSource.fetch."""
        deadline = time.monotonic() + wait.total_seconds()
        while True:
            try:
                doc = json.loads(self.path.read_text())
            except FileNotFoundError as e:
                raise SourceUnavailable(f"{self.path}: missing") from e
            except (OSError, ValueError) as e:
                raise SourceUnavailable(f"{self.path}: {e}") from e
            if int(doc["version"]) > after_version:
                schedule = Schedule.model_validate(doc["schedule"])
                a = assignment_from_schedule(
                    schedule, int(doc["version"]), self.worker, self.num_pipelines, self.num_microbatches
                )
                return replace(a, state=str(doc.get("state", "running")))
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_s)


class HttpScheduleSource:
    """The service's long-poll endpoint for one worker (each poll is also its heartbeat)."""

    def __init__(
        self,
        service: str,
        job_id: str,
        token: str,
        worker: Worker,
        num_pipelines: int,
        num_stages: int,
        num_microbatches: int,
    ) -> None:
        self.base = service.rstrip("/")
        self.job_id, self.token, self.worker = job_id, token, worker
        self.dims = (num_pipelines, num_stages, num_microbatches)

    def fetch(self, after_version: int, wait: timedelta) -> Assignment | None:
        """See ScheduleSource.fetch."""
        d, s = self.worker
        url = (
            f"{self.base}/v1/jobs/{self.job_id}/schedule?worker={d},{s}"
            f"&after_version={after_version}&wait={wait.total_seconds():g}"
        )
        req = urllib.request.Request(
            url, headers={"Authorization": f"Bearer {self.token}", "If-None-Match": f'"{after_version}"'}
        )
        try:
            with urllib.request.urlopen(req, timeout=wait.total_seconds() + 10) as resp:
                view = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            if e.code == 304:
                return None
            detail = _detail(e)
            if 400 <= e.code < 500 and e.code not in RETRIED_4XX:
                raise SourceRejected(f"{url}: HTTP {e.code} {detail}") from e
            raise SourceUnavailable(f"{url}: HTTP {e.code} {detail}") from e
        except (OSError, ValueError) as e:
            raise SourceUnavailable(f"{url}: {e}") from e
        return assignment_from_view(view, *self.dims)


RETRIED_4XX = (408, 425, 429)


def _detail(e: urllib.error.HTTPError) -> str:
    """The `detail` of an error answer, if it has one (for the log)."""
    try:
        return str(json.loads(e.read()).get("detail", ""))
    except (OSError, ValueError, AttributeError):
        return ""


class ScheduleClient:
    """Background long-poll loop; `latest()` / `wait_newer()` for the worker, `on_new` for interrupts."""

    def __init__(
        self,
        source: ScheduleSource,
        on_new: Callable[[Assignment], None] | None = None,
        on_error: Callable[[SourceRejected], None] | None = None,
        poll_wait: timedelta = POLL_WAIT,
        max_backoff: timedelta = MAX_BACKOFF,
    ) -> None:
        self.source, self.on_new, self.on_error = source, on_new, on_error
        self.error: SourceRejected | None = None
        self.poll_wait, self.max_backoff = poll_wait, max_backoff
        self._latest: Assignment | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.unreachable_since: float | None = None
        self._thread = threading.Thread(target=self._loop, name="recycle-client", daemon=True)

    def start(self) -> ScheduleClient:
        """Start polling."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (after the poll in flight)."""
        self._stop.set()

    def latest(self) -> Assignment | None:
        """The newest assignment seen so far."""
        with self._cond:
            return self._latest

    def poll(self) -> Assignment | None:
        """Alias of latest(): the verb the worker loop uses at safe points."""
        return self.latest()

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
        backoff = 0.05
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
                if self.unreachable_since is None:
                    self.unreachable_since = time.monotonic()
                    logger.warning("schedule source unreachable, keeping version %d: %s", current, e)
                self._stop.wait(backoff)
                backoff = min(2 * backoff, self.max_backoff.total_seconds())
                continue
            if self.unreachable_since is not None:
                logger.info("schedule source reachable again")
                self.unreachable_since = None
            backoff = 0.05
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
