"""Schedule client: long-polls a schedule source and hands new versions to the worker.

Two sources behind one small interface: the service (GET /v1/jobs/{id}/schedule?worker=d,s with
after_version, wait, Bearer token, ETag / If-None-Match) and a schedule file holding the same envelope
({"version": N, "schedule": {...}}). While the source is unreachable the client backs off (exponential,
full jitter: backoff.py) and the worker keeps running the last schedule it has.

The service grants a worker's poll at most a third of the job's heartbeat timeout (it says how long
in the Recycle-Poll-Wait-Max header) and counts a worker alive only from its polls arriving: the
client asks for no longer a wait than that. A worker that completed its iterations calls `done()`:
polling stops and the service is told (a `done` event), so the worker's silence is not a failure.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from planner.contract import Schedule
from runtime_adapter.assignment import Assignment, Worker, assignment_from_schedule, assignment_from_view
from runtime_adapter.backoff import Backoff
from runtime_adapter.settings import runtime_settings

logger = logging.getLogger(__name__)

BASE_BACKOFF_S = 0.05  # the first retry waits up to this long; the ceiling doubles to MAX_BACKOFF
WAIT_HEADER = "recycle-poll-wait-max"  # the longest wait the service grants this worker's poll, seconds
DONE_DEADLINE_S = 10.0  # how long done() keeps retrying an unreachable service


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

    def done(self) -> bool:
        """Nothing to tell: a schedule file has no heartbeats."""
        return True


class HttpScheduleSource:
    """The service's long-poll endpoint for one worker (each poll is also its heartbeat).

    One persistent httpx client (keep-alive): every poll of the worker reuses its connection instead of
    opening a new one; a connection the service closed is replaced on the next poll.
    """

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
        import httpx  # the worker needs it only with --service

        self.base = service.rstrip("/")
        self.job_id, self.token, self.worker = job_id, token, worker
        self.dims = (num_pipelines, num_stages, num_microbatches)
        self.max_wait_s: float | None = None  # the service's cap on this worker's wait, once it said it
        self._httpx = httpx
        self._http = httpx.Client(
            headers={"Authorization": f"Bearer {token}"},
            follow_redirects=True,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )

    def fetch(self, after_version: int, wait: timedelta) -> Assignment | None:
        """See ScheduleSource.fetch."""
        d, s = self.worker
        wait_s = wait.total_seconds()
        if self.max_wait_s is not None:
            wait_s = min(wait_s, self.max_wait_s)  # a longer wait would be cut by the service anyway
        url = (
            f"{self.base}/v1/jobs/{self.job_id}/schedule?worker={d},{s}"
            f"&after_version={after_version}&wait={wait_s:g}"
        )
        httpx = self._httpx
        try:
            resp = self._http.get(
                url,
                headers={"If-None-Match": f'"{after_version}"'},
                timeout=httpx.Timeout(wait_s + 10),
            )
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as e:
            raise SourceUnavailable(f"{url}: {type(e).__name__}: {e}") from e
        self._learn_wait(resp.headers.get(WAIT_HEADER))
        code = resp.status_code
        if code == 304:
            return None
        if not 200 <= code < 300:
            detail = _detail(resp.content)
            if 400 <= code < 500 and code not in RETRIED_4XX:
                raise SourceRejected(f"{url}: HTTP {code} {detail}")
            raise SourceUnavailable(f"{url}: HTTP {code} {detail}")
        try:
            view = json.loads(resp.content)
        except ValueError as e:
            raise SourceUnavailable(f"{url}: {e}") from e
        return assignment_from_view(view, *self.dims)

    def _learn_wait(self, value: str | None) -> None:
        """Keep the service's cap on this worker's wait (an absent or odd header changes nothing)."""
        if value is None:
            return
        try:
            cap = float(value)
        except ValueError:
            return
        if math.isfinite(cap) and cap > 0:
            self.max_wait_s = cap

    def done(self, deadline_s: float = DONE_DEADLINE_S) -> bool:
        """Tell the service this worker completed its iterations (POST events `{"kind": "done"}` with
        the worker token): it is then never declared failed for its silence, and the job turns
        `finished` once every alive worker is done. Retried with the same event_id (the service
        applies it once) on transport errors, 5xx, 408, 425 and 429 until `deadline_s`; True when
        the service took it. Uses a connection of its own: the poll's may still be parked."""
        httpx = self._httpx
        d, s = self.worker
        url = f"{self.base}/v1/jobs/{self.job_id}/events"
        body = {
            "event_id": f"done-{d}-{s}-{uuid.uuid4().hex[:12]}",
            "kind": "done",
            "workers": [[d, s]],
            "reason": "completed its iterations",
        }
        deadline = time.monotonic() + deadline_s
        backoff = Backoff(BASE_BACKOFF_S, 1.0)
        with httpx.Client(headers={"Authorization": f"Bearer {self.token}"}, follow_redirects=True) as http:
            while True:
                try:
                    resp = http.post(url, json=body, timeout=httpx.Timeout(5.0))
                except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as e:
                    error = f"{type(e).__name__}: {e}"
                else:
                    code = resp.status_code
                    if code == 200:
                        logger.info("told the service this worker is done: job %s", resp.json().get("state"))
                        return True
                    error = f"HTTP {code} {_detail(resp.content)}"
                    if 400 <= code < 500 and code not in RETRIED_4XX:
                        logger.error("the service refused this worker's `done`: %s", error)
                        return False
                delay = backoff.next()
                if time.monotonic() + delay > deadline:
                    logger.warning("could not tell the service this worker is done: %s", error)
                    return False
                time.sleep(delay)

    def close(self) -> None:
        """Close the connection (the client's poll thread calls it when it stops)."""
        self._http.close()


RETRIED_4XX = (408, 425, 429)


def _detail(body: bytes) -> str:
    """The `detail` of an error answer, if it has one (for the log)."""
    try:
        return str(json.loads(body).get("detail", ""))
    except (ValueError, AttributeError):
        return ""


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
        self._thread = threading.Thread(target=self._loop, name="recycle-client", daemon=True)

    def start(self) -> ScheduleClient:
        """Start polling."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (after the poll in flight)."""
        self._stop.set()

    def done(self) -> bool:
        """The worker completed its iterations: stop polling and tell the source (the service then
        does not take the worker's silence for a failure); True when the source took it."""
        self.stop()
        tell = getattr(self.source, "done", None)
        return True if tell is None else bool(tell())

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
