"""Telling the schedule source what a worker did: `done` (it completed its iterations) and `checkpoint`
(its stage's checkpoint at a stepped count is durable) events, and the thread that sends checkpoint
reports in order without making the training loop or the checkpoint writer wait for the network.

An event is POSTed to the job's events with the worker token and retried with the same event_id (the
service applies it once) on transport errors, 5xx, 408, 425 and 429 until its deadline; any other 4xx
is final. Each post uses a connection of its own: the worker's poll may still be parked on its own.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from runtime_adapter.backoff import Backoff

logger = logging.getLogger(__name__)

BASE_BACKOFF_S = 0.05  # the first retry waits up to this long; the ceiling doubles to MAX_BACKOFF
DONE_DEADLINE_S = 10.0  # how long an event post (done, checkpoint) keeps retrying an unreachable service
RETRIED_4XX = (408, 425, 429)


def error_detail(body: bytes) -> str:
    """The `detail` of an error answer, if it has one (for the log)."""
    try:
        return str(json.loads(body).get("detail", ""))
    except (ValueError, AttributeError):
        return ""


def done_event(worker: tuple[int, int]) -> dict[str, object]:
    """The `done` event of `worker` (a fresh event_id: one per process that finished)."""
    d, s = worker
    return {
        "event_id": f"done-{d}-{s}-{uuid.uuid4().hex[:12]}",
        "kind": "done",
        "workers": [[d, s]],
        "reason": "completed its iterations",
    }


def checkpoint_event(worker: tuple[int, int], iteration: int) -> dict[str, object]:
    """The `checkpoint` event: `worker`'s stage has a durable checkpoint at stepped count `iteration`."""
    d, s = worker
    return {
        "event_id": f"checkpoint-{d}.{s}-{iteration}-{uuid.uuid4().hex[:12]}",
        "kind": "checkpoint",
        "workers": [[d, s]],
        "iteration": iteration,
    }


def post_event(httpx: Any, url: str, token: str, body: Mapping[str, object], deadline_s: float) -> bool:
    """POST `body` to the job's events `url`, retried with the same event_id until `deadline_s`; True
    when the service took it (`httpx`: the module, imported by the caller only with --service)."""
    kind = body["kind"]
    deadline = time.monotonic() + deadline_s
    backoff = Backoff(BASE_BACKOFF_S, 1.0)
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, follow_redirects=True) as http:
        while True:
            try:
                resp = http.post(url, json=body, timeout=httpx.Timeout(5.0))
            except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as e:
                error = f"{type(e).__name__}: {e}"
            else:
                code = resp.status_code
                if code == 200:
                    logger.info("told the service `%s`: job %s", kind, resp.json().get("state"))
                    return True
                error = f"HTTP {code} {error_detail(resp.content)}"
                if 400 <= code < 500 and code not in RETRIED_4XX:
                    logger.error("the service refused this worker's `%s`: %s", kind, error)
                    return False
            delay = backoff.next()
            if time.monotonic() + delay > deadline:
                logger.warning("could not tell the service `%s`: %s", kind, error)
                return False
            time.sleep(delay)


class CheckpointReports:
    """Checkpoint reports sent in order from a thread of their own (started by the first report), each
    through `tell(iteration)` (the source's `checkpoint`; None: nothing to tell, e.g. a schedule file
    without it). A report is best effort: a lost one only makes a restore use an older checkpoint."""

    def __init__(self, tell: Callable[[int], object] | None) -> None:
        self.tell = tell
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, iteration: int) -> None:
        """Queue the report of the checkpoint at stepped count `iteration` (never blocks)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="recycle-reports", daemon=True)
                self._thread.start()
        self._queue.put(iteration)

    def flush(self, timeout_s: float = DONE_DEADLINE_S) -> None:
        """Wait (up to `timeout_s`) until every queued report was delivered or given up."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            iteration = self._queue.get()
            if iteration is None:
                return
            if self.tell is not None:
                try:
                    self.tell(iteration)
                except Exception:  # a report is best effort: the service restores from an older one
                    logger.exception("checkpoint report %d failed", iteration)
