"""Where a worker's schedule versions come from, behind one small interface (`ScheduleSource.fetch`):

- `FileScheduleSource`: a schedule file holding the envelope {"version": N, "schedule": {...}} (plus the
  restore protocol's optional fields), replaced atomically by the launcher;
- `HttpScheduleSource`: the service's long-poll (GET /v1/jobs/{id}/schedule?worker=d,s with
  after_version, wait, Bearer token, ETag / If-None-Match; each poll is also the worker's heartbeat).
  The service grants a worker's poll at most a third of the job's heartbeat timeout and says how long
  in the Recycle-Poll-Wait-Max header: the source asks for no longer a wait than that. Its `done` and
  `checkpoint` events go out through reports.py.

A source raises SourceUnavailable (retried with backoff by client.py) or SourceRejected (final).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from planner.contract import Schedule
from runtime_adapter.assignment import (
    Assignment,
    Worker,
    assignment_from_schedule,
    assignment_from_view,
    envelope_fields,
)
from runtime_adapter.heartbeats import Heartbeat
from runtime_adapter.reports import (
    DONE_DEADLINE_S,
    RETRIED_4XX,
    checkpoint_event,
    done_event,
    error_detail,
    post_event,
)

WAIT_HEADER = "recycle-poll-wait-max"  # the longest wait the service grants this worker's poll, seconds


class SourceUnavailable(Exception):
    """The schedule source cannot be reached or answered garbage (retried with backoff)."""


class SourceRejected(Exception):
    """The source refused this worker for good (HTTP 401, 403, 404, other 4xx): retrying cannot help."""


class ScheduleSource(Protocol):
    """Where schedule versions come from."""

    def fetch(self, after_version: int, wait: timedelta) -> Assignment | None:
        """This worker's assignment in the first version above `after_version`, or None after `wait`."""
        ...


def envelope_problem(doc: object) -> str | None:
    """Why `doc` is not a schedule envelope {"version": N, "schedule": {...}}, or None."""
    if not isinstance(doc, dict) or "schedule" not in doc or "version" not in doc:
        return (
            'not a schedule envelope {"version": N, "schedule": ...} (a bare schedule, e.g. what '
            '`recycle plan -o` writes, goes under "schedule" with a version)'
        )
    if isinstance(doc["version"], bool) or not isinstance(doc["version"], int) or doc["version"] < 0:
        return f"version: expected a non-negative integer, got {doc['version']!r}"
    return None


class FileScheduleSource:
    """A JSON file with {"version": N, "schedule": <CONTRACT.md schedule>}, replaced atomically."""

    def __init__(
        self,
        path: Path,
        worker: Worker,
        num_pipelines: int,
        num_microbatches: int,
        poll_s: float = 0.02,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        """`heartbeat`: touched on every read of the file (runtime_adapter/heartbeats.py)."""
        self.path, self.worker, self.poll_s = Path(path), worker, poll_s
        self.num_pipelines, self.num_microbatches = num_pipelines, num_microbatches
        self.heartbeat = heartbeat

    def fetch(self, after_version: int, wait: timedelta) -> Assignment | None:
        """See ScheduleSource.fetch."""
        deadline = time.monotonic() + wait.total_seconds()
        while True:
            if self.heartbeat is not None:
                self.heartbeat.beat()
            try:
                doc = json.loads(self.path.read_text())
            except FileNotFoundError as e:
                raise SourceUnavailable(f"{self.path}: missing") from e
            except (OSError, ValueError) as e:
                raise SourceUnavailable(f"{self.path}: {e}") from e
            problem = envelope_problem(doc)
            if problem is not None:
                raise SourceUnavailable(f"{self.path}: {problem}")
            if int(doc["version"]) > after_version:
                schedule = Schedule.model_validate(doc["schedule"])
                a = assignment_from_schedule(
                    schedule, int(doc["version"]), self.worker, self.num_pipelines, self.num_microbatches
                )
                fields = envelope_fields(doc, self.worker)
                if not a.alive:
                    fields["joined_at"] = None
                return replace(a, state=str(doc.get("state", "running")), **fields)
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_s)

    def done(self) -> bool:
        """Nothing to tell, but the heartbeat file goes: the launcher stops tracking this worker."""
        if self.heartbeat is not None:
            self.heartbeat.end()
        return True

    def checkpoint(self, iteration: int) -> bool:
        """Nothing to tell: the launcher reads the checkpoint directory itself."""
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
        self._events_url = f"{self.base}/v1/jobs/{job_id}/events"
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
            detail = error_detail(resp.content)
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
        """Tell the service this worker completed its iterations (reports.done_event): it is then never
        declared failed for its silence, and the job turns `finished` once every alive worker is done.
        True when the service took it (reports.post_event: retried until `deadline_s`)."""
        return post_event(self._httpx, self._events_url, self.token, done_event(self.worker), deadline_s)

    def checkpoint(self, iteration: int, deadline_s: float = DONE_DEADLINE_S) -> bool:
        """Report that this worker's stage has a durable checkpoint at stepped count `iteration`
        (reports.checkpoint_event; the service restores from the newest iteration every stage
        reported). Retried like `done`; True when the service took it."""
        body = checkpoint_event(self.worker, iteration)
        return post_event(self._httpx, self._events_url, self.token, body, deadline_s)

    def close(self) -> None:
        """Close the connection (the client's poll thread calls it when it stops)."""
        self._http.close()
