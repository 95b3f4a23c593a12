"""The launcher as the controller of its job on the planner service, or an agent attached to a job
with its worker token (`ServicePublisher`).

It registers the job (or attaches to one), posts `fail` / `rejoin` events with unique event_ids, and
lets the service pick and version the schedules that the workers long-poll. It follows the job's
versions (supervisor_follow.py: a long-poll of the full schedule, never a heartbeat) so that its
supervisor learns of the restores the service publishes when a stage is lost. Events the service could
not take (unreachable, 5xx) wait in an outbox and are re-sent with the same event_id, which the
service applies once. Retries wait with exponential backoff and full jitter (backoff.py); the
registration carries an Idempotency-Key, so a retry after a lost answer does not register a second job.

Workers that completed their iterations tell the service themselves (a `done` event each, client.py),
so the job turns `finished` and their silence is never taken for a failure: the heartbeat stays on
until the end. An event for a finished job (409 `job_finished`) has nothing left to change: dropped.
"""

from __future__ import annotations

import json
import logging
import random
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from planner.contract import JobSpec
from runtime_adapter.assignment import Worker
from runtime_adapter.backoff import Backoff
from runtime_adapter.publishers import Outcome, PublisherError, RegistrationRefused, Restore, refusal_text
from runtime_adapter.supervisor_follow import VersionFollower

logger = logging.getLogger(__name__)

RETRY_BACKOFF_S, RETRY_MAX_BACKOFF_S = 0.1, 1.0  # registration and status calls: retried until a deadline
OUTBOX_BACKOFF_S, OUTBOX_MAX_BACKOFF_S = 0.1, 1.0  # undelivered events: re-sent by flush() after this


class ServicePublisher:
    """The controller of one job on the planner service (plain urllib: no extra dependency)."""

    def __init__(
        self,
        url: str,
        controller_token: str,
        job: JobSpec,
        max_failures: int = 1,
        heartbeat_enabled: bool = True,
        heartbeat_timeout_s: float | None = None,
        job_id: str | None = None,
        worker_token: str | None = None,
        timeout_s: float = 30.0,
        rng: random.Random | None = None,
        restore_policy: str | None = None,
        repartition: bool = False,
    ) -> None:
        """`restore_policy` ("auto" / "manual", default: the service's, auto): whether the service
        restores a lost stage from the checkpoints by itself. `repartition`: the service's plans move
        layers between stages too (the job spec needs per-layer figures; docs/service.md)."""
        self.base, self.token, self.job = url.rstrip("/"), controller_token, job
        self.registration: dict[str, Any] = {
            "job": json.loads(job.model_dump_json()),
            "max_failures": max_failures,
            "heartbeat_enabled": heartbeat_enabled,
            "heartbeat_timeout_s": heartbeat_timeout_s,
        }
        if restore_policy is not None:
            self.registration["restore_policy"] = restore_policy
        if repartition:
            self.registration["repartition"] = True
        self.job_id: str | None = job_id  # the registered (or attached) job, once start() returned
        self.worker_token, self.timeout_s = worker_token, timeout_s
        self.rng = rng if rng is not None else random.Random()
        self.outbox_backoff = Backoff(OUTBOX_BACKOFF_S, OUTBOX_MAX_BACKOFF_S, self.rng)
        self.retry_at = 0.0  # monotonic time before which flush() does not re-send the outbox
        self.run_id = uuid.uuid4().hex[:12]
        self.seq = 0
        self.outbox: list[dict[str, Any]] = []
        self.version = 0
        self.answers: list[tuple[int, dict[str, Any]]] = []
        self.follower: VersionFollower | None = None  # started by start(); stopped by finish()
        self.answered_restore: Restore | None = None  # the newest restore an event's answer named

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer); raises OSError when the service cannot be reached."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base}{path}", data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                answer = json.loads(e.read() or b"{}")
            except ValueError:
                answer = {}
            return e.code, answer

    def _retrying(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        deadline_s: float,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        deadline = time.monotonic() + deadline_s
        backoff = Backoff(RETRY_BACKOFF_S, RETRY_MAX_BACKOFF_S, self.rng)
        while True:
            try:
                status, answer = self._call(method, path, body, headers)
                if status < 500:
                    return status, answer
                error: object = f"HTTP {status} {answer}"
            except OSError as e:
                error = e
            if time.monotonic() > deadline:
                raise PublisherError(f"{method} {path}: service unavailable for {deadline_s:g} s ({error})")
            time.sleep(backoff.next())

    def start(self) -> None:
        """Register the job (unless attached to one with job_id and worker_token)."""
        if self.job_id is not None and self.worker_token is not None:
            status, answer = self._retrying("GET", f"/v1/jobs/{self.job_id}", None, self.timeout_s)
            if status != 200:
                raise PublisherError(f"job {self.job_id}: HTTP {status} {answer}")
            self.version = int(answer["version"])
            self._follow()
            return
        # One key per registration, the same on every retry: if the service committed the job but its
        # answer was lost (timeout, reset), the retry gets that job back instead of a second one.
        key = {"Idempotency-Key": uuid.uuid4().hex}
        status, answer = self._retrying("POST", "/v1/jobs", self.registration, self.timeout_s, key)
        if 400 <= status < 500:
            raise RegistrationRefused(f"the service refused the job ({refusal_text(status, answer)})")
        if status != 201:
            raise PublisherError(f"registering the job: HTTP {status} {answer}")
        self.job_id, self.worker_token = answer["id"], answer["worker_token"]
        self.version = int(answer["version"])
        logger.info("job %s registered on %s (v%d)", self.job_id, self.base, self.version)
        self._follow()

    def _follow(self) -> None:
        assert self.job_id is not None
        self.follower = VersionFollower(self.base, self.job_id, self.token).start()

    def latest_restore(self) -> Restore | None:
        """See Publisher.latest_restore: the newest restore of the versions followed or of the event
        answers (an event that lost a stage answers with the restore it caused)."""
        latest = None if self.follower is None else self.follower.latest
        followed = None if latest is None else latest.restore
        answered = self.answered_restore
        if followed is None or (answered is not None and answered.epoch > followed.epoch):
            return answered
        return followed

    def fenced(self) -> frozenset[Worker]:
        """The workers the newest version followed names failed (the service's heartbeat failed a
        worker whose process may still run: hung, stopped, partitioned)."""
        latest = None if self.follower is None else self.follower.latest
        return frozenset() if latest is None else latest.failed

    def silent(self, running: Mapping[Worker, int]) -> list[Worker]:
        """None: the service watches the workers' polls itself and fails the silent ones (`fenced`)."""
        return []

    def job_state(self) -> str | None:
        """The state of the newest version followed (None: none seen yet)."""
        latest = None if self.follower is None else self.follower.latest
        return None if latest is None else latest.state

    def worker_args(self) -> list[str]:
        """See Publisher.worker_args."""
        assert self.job_id is not None and self.worker_token is not None, "start() first"
        # `--flag=value`: a value starting with "-" (url-safe tokens can) is not taken for a flag
        return [f"--service={self.base}", f"--job-id={self.job_id}", f"--token={self.worker_token}"]

    def report(
        self, kind: str, workers: Sequence[Worker], reason: str = "", event_id: str | None = None
    ) -> Outcome:
        """Post the event now, or queue it (same event_id) while the service is unreachable."""
        self.seq += 1
        event_id = event_id or f"{self.run_id}-{self.seq}"
        event: dict[str, Any] = {
            "event_id": event_id,
            "kind": kind,
            "workers": [list(w) for w in sorted(workers)],
            "reason": reason or None,
        }
        self.outbox.append(event)
        outcomes = self._drain()
        return outcomes.get(event_id, Outcome(None))

    def restore_lost(self, left: Sequence[tuple[Worker, str]], reason: str) -> Outcome:
        """See Publisher.restore_lost. The service has no event for it: each worker that left is
        reported failed (`fail`, the given event_id: it is not running), until the service answers
        with a restore (restore policy auto: when a stage has no worker left) or every one was sent."""
        before = self.latest_restore()
        lost: set[int] = set()
        version = None
        for w, event_id in left:
            outcome = self.report("fail", [w], reason, event_id)
            version, restore = outcome.version, self.latest_restore()
            lost.update(outcome.lost_stages)
            if restore is not None and (before is None or restore.epoch > before.epoch):
                break
        return Outcome(version, sorted(lost))

    def flush(self) -> list[int]:
        """See Publisher.flush."""
        if self.follower is not None and self.follower.error is not None:
            raise PublisherError(f"the service refused us: {self.follower.error}")
        if not self.outbox or time.monotonic() < self.retry_at:
            return []
        return sorted({s for o in self._drain().values() for s in o.lost_stages})

    def _drain(self) -> dict[str, Outcome]:
        """Send the outbox in order until it is empty or the service is unreachable (then the next
        flush waits for a jittered, growing delay: retry_at)."""
        outcomes: dict[str, Outcome] = {}
        stuck = self._send_outbox(outcomes)
        if stuck:
            self.retry_at = time.monotonic() + self.outbox_backoff.next()
        else:
            self.outbox_backoff.reset()
            self.retry_at = 0.0
        return outcomes

    def _send_outbox(self, outcomes: dict[str, Outcome]) -> bool:
        """Deliver in order into `outcomes`; True if an event had to stay (service unavailable)."""
        while self.outbox:
            event = self.outbox[0]
            try:
                status, answer = self._call("POST", f"/v1/jobs/{self.job_id}/events", event)
            except OSError as e:
                logger.warning("event %s kept for later: service unreachable (%s)", event["event_id"], e)
                return True
            if status >= 500:
                logger.warning("event %s kept for later: HTTP %d", event["event_id"], status)
                return True
            self.outbox.pop(0)
            self.answers.append((status, answer))
            if status == 200:
                self.version = max(self.version, int(answer["version"]))
                lost = [int(x) for x in answer.get("unrecoverable_stages") or []]
                outcomes[event["event_id"]] = Outcome(int(answer["version"]), lost)
                restore = Restore.from_envelope(answer)
                if restore is not None and (self.answered_restore is None or
                                            restore.epoch > self.answered_restore.epoch):  # fmt: skip
                    self.answered_restore = restore
            elif status == 409 and answer.get("error") == "unrecoverable":
                logger.error("event %s: unrecoverable, stages %s lost", event["event_id"], answer["stages"])
                outcomes[event["event_id"]] = Outcome(None, [int(s) for s in answer["stages"]])
            elif status == 409 and answer.get("error") == "job_finished":
                logger.info("event %s dropped: the job is finished", event["event_id"])
                outcomes[event["event_id"]] = Outcome(self.version)
                continue
            else:
                raise PublisherError(f"event {event}: HTTP {status} {answer}")
            logger.info("event %s (%s %s): %s", event["event_id"], event["kind"], event["workers"], answer)
        return False

    def finish(self) -> None:
        """Stop following; deliver what the outbox still holds (best effort). The heartbeat stays on:
        workers that completed posted `done` themselves, so the service neither declares them failed
        nor needs to be told anything else (the job is `finished` once every alive worker is done)."""
        if self.follower is not None:
            self.follower.stop()
        if self.outbox and time.monotonic() >= self.retry_at:
            self._drain()

    def status(self) -> dict[str, Any]:
        """GET /v1/jobs/{id}."""
        status, answer = self._retrying("GET", f"/v1/jobs/{self.job_id}", None, self.timeout_s)
        if status != 200:
            raise PublisherError(f"job {self.job_id}: HTTP {status} {answer}")
        return answer

    def deliver(self, timeout_s: float) -> None:
        """Deliver the outbox, retrying for up to `timeout_s` (PublisherError if it could not)."""
        deadline = time.monotonic() + timeout_s
        self.flush()
        while self.outbox:
            if time.monotonic() > deadline:
                raise PublisherError(f"service unreachable: events {self.outbox} not delivered")
            time.sleep(max(0.0, self.retry_at - time.monotonic()))
            self.flush()
