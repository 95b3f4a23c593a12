"""Following a service job's versions from outside the workers (the agent, the launcher).

`VersionFollower` long-polls the job's FULL schedule (GET /v1/jobs/{id}/schedule without `worker=`:
never a heartbeat, so the follower is not taken for a worker) in a background thread and keeps the
newest version's number, state and `restore` field. The supervisor reads them on every tick: a
restore epoch above the last one it followed makes it restart its workers that are not running.

While the service is unreachable (or answers 5xx) the follower retries with jittered backoff
(backoff.py); a 401, 403 or 404 is final (`error`): the token is refused or the job is gone.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

from runtime_adapter.backoff import Backoff
from runtime_adapter.publishers import Restore

logger = logging.getLogger(__name__)

FOLLOW_WAIT_S = 10.0  # each long-poll's wait (the service caps it further); bounds stop()'s delay


@dataclass(frozen=True)
class Followed:
    """The newest version the follower saw."""

    version: int
    state: str
    restore: Restore | None
    failed: frozenset[tuple[int, int]] = frozenset()  # the version's failed workers


class VersionFollower:
    """Background long-poll of a job's full schedule (see the module docstring)."""

    def __init__(self, base: str, job_id: str, token: str, wait_s: float = FOLLOW_WAIT_S) -> None:
        self.url = f"{base.rstrip('/')}/v1/jobs/{job_id}/schedule"
        self.token, self.wait_s = token, wait_s
        self.latest: Followed | None = None  # replaced whole (one assignment): safe to read anywhere
        self.error: str | None = None  # set once the service refused us for good
        self._stop = threading.Event()
        self._new = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="recycle-follow", daemon=True)

    def start(self) -> VersionFollower:
        """Start following."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the poll in flight (a daemon thread: never holds the process)."""
        self._stop.set()

    def wait_change(self, timeout_s: float) -> bool:
        """Block until a new version arrived (or `timeout_s`); True if one did (tests, the agent's loop)."""
        got = self._new.wait(timeout_s)
        self._new.clear()
        return got

    def _get(self, after: int) -> tuple[int, bytes]:
        req = urllib.request.Request(f"{self.url}?after_version={after}&wait={self.wait_s:g}")
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("If-None-Match", f'"{after}"')
        try:
            with urllib.request.urlopen(req, timeout=self.wait_s + 10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read() or b""

    def _loop(self) -> None:
        backoff = Backoff(0.05, 1.0)
        while not self._stop.is_set():
            after = self.latest.version if self.latest is not None else 0
            try:
                status, body = self._get(after)
            except OSError as e:  # unreachable, reset, timeout: keep the last version, retry
                logger.debug("following the job: %s", e)
                self._stop.wait(backoff.next())
                continue
            if status == 304:
                backoff.reset()
                continue
            if status in (401, 403, 404):
                self.error = f"GET {self.url}: HTTP {status} {body[:200].decode(errors='replace')}"
                logger.error("stopped following the job: %s", self.error)
                self._new.set()
                return
            try:
                doc = json.loads(body) if status == 200 else None
            except ValueError:
                doc = None
            if not isinstance(doc, dict) or "version" not in doc:
                self._stop.wait(backoff.next())
                continue
            backoff.reset()
            failed = frozenset((int(d), int(s)) for d, s in (doc.get("schedule") or {}).get("failed") or [])
            state = str(doc.get("state", "running"))
            got = Followed(int(doc["version"]), state, Restore.from_envelope(doc), failed)
            if self.latest is None or got.version > self.latest.version:
                self.latest = got
                self._new.set()
