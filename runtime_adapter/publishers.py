"""Where the launcher publishes failure-set changes: a schedule file, or the planner service.

`FilePublisher` keeps the failure set itself and writes the schedule of each new set (from
`schedule_for`: the planner in tests, a directory of precomputed schedules on the CLI) as the next
version of the file the workers poll. `ServicePublisher` is the controller of a job on the service:
it registers the job (or attaches to one), posts `fail` / `rejoin` events with unique event_ids, and
lets the service pick and version the schedules that the workers long-poll. Events the service
could not take (unreachable, 5xx) wait in an outbox and are re-sent with the same event_id, which
the service applies once.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from planner.contract import JobSpec, Schedule
from runtime_adapter.assignment import Worker

logger = logging.getLogger(__name__)

ScheduleFor = Callable[[frozenset[Worker]], Schedule]


def lost_stages(failed: frozenset[Worker] | set[Worker], num_pipelines: int, num_stages: int) -> list[int]:
    """Stages whose every worker is in `failed` (the failure set is then unrecoverable)."""
    return [s for s in range(num_stages) if all((d, s) in failed for d in range(num_pipelines))]


def publish(path: Path, version: int, schedule: Schedule, state: str = "running") -> None:
    """Atomically replace the schedule file with version `version`."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    doc = {
        "version": version,
        "state": state,
        "schedule": json.loads(schedule.model_dump_json(exclude_none=True)),
    }
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


@dataclass
class Outcome:
    """The answer to a reported event: the version it made (None while it waits in the outbox) and
    the stages lost if the failure set is unrecoverable."""

    version: int | None
    lost_stages: list[int] = field(default_factory=list)


class PublisherError(RuntimeError):
    """The service refused the controller (bad token, unknown job, invalid event): not retried."""


class Publisher(Protocol):
    """What the launcher needs from a schedule publisher."""

    version: int

    def start(self) -> None:
        """Publish version 1 (the failure-free schedule)."""
        ...

    def worker_args(self) -> list[str]:
        """Command-line flags telling a worker where to poll."""
        ...

    def report(self, kind: str, workers: Sequence[Worker], reason: str = "") -> Outcome:
        """Report workers failed (`fail`) or back (`rejoin`)."""
        ...

    def flush(self) -> list[int]:
        """Re-send what could not be delivered yet (called on every supervision tick); the stages
        lost if a delivered event turned out unrecoverable."""
        ...

    def restored(self) -> int:
        """Every worker restarts from a checkpoint: publish the failure-free schedule; its version."""
        ...

    def finish(self) -> None:
        """The job is over (every worker exited)."""
        ...


class FilePublisher:
    """A schedule file `{"version", "state", "schedule"}` replaced atomically on each change."""

    def __init__(self, path: Path, job: JobSpec, schedule_for: ScheduleFor) -> None:
        self.path, self.job, self.schedule_for = Path(path), job, schedule_for
        self.failed: set[Worker] = set()
        self.version = 0

    def _publish(self) -> int:
        self.version += 1
        publish(self.path, self.version, self.schedule_for(frozenset(self.failed)))
        logger.info("published schedule v%d for failed %s", self.version, sorted(self.failed))
        return self.version

    def start(self) -> None:
        """See Publisher.start."""
        self._publish()

    def worker_args(self) -> list[str]:
        """See Publisher.worker_args."""
        return ["--schedule-file", str(self.path)]

    def report(self, kind: str, workers: Sequence[Worker], reason: str = "") -> Outcome:
        """See Publisher.report. An unrecoverable set is not published (the launcher restores)."""
        if kind == "fail":
            self.failed.update(workers)
        elif kind == "rejoin":
            self.failed.difference_update(workers)
        lost = lost_stages(frozenset(self.failed), self.job.num_pipelines, self.job.num_stages)
        if lost:
            return Outcome(None, lost)
        return Outcome(self._publish())

    def flush(self) -> list[int]:
        """Nothing is ever pending."""
        return []

    def restored(self) -> int:
        """See Publisher.restored."""
        self.failed.clear()
        return self._publish()

    def finish(self) -> None:
        """Nothing to do."""


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
    ) -> None:
        self.base, self.token, self.job = url.rstrip("/"), controller_token, job
        self.registration: dict[str, Any] = {
            "job": json.loads(job.model_dump_json()),
            "max_failures": max_failures,
            "heartbeat_enabled": heartbeat_enabled,
            "heartbeat_timeout_s": heartbeat_timeout_s,
        }
        self.job_id, self.worker_token, self.timeout_s = job_id, worker_token, timeout_s
        self.run_id = uuid.uuid4().hex[:12]
        self.seq = 0
        self.outbox: list[dict[str, Any]] = []
        self.version = 0
        self.answers: list[tuple[int, dict[str, Any]]] = []

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer); raises OSError when the service cannot be reached."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base}{path}", data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
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
        self, method: str, path: str, body: dict[str, Any] | None, deadline_s: float
    ) -> tuple[int, dict[str, Any]]:
        deadline = time.monotonic() + deadline_s
        delay = 0.1
        while True:
            try:
                status, answer = self._call(method, path, body)
                if status < 500:
                    return status, answer
                error: object = f"HTTP {status} {answer}"
            except OSError as e:
                error = e
            if time.monotonic() > deadline:
                raise PublisherError(f"{method} {path}: service unavailable for {deadline_s:g} s ({error})")
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def start(self) -> None:
        """Register the job (unless attached to one with job_id and worker_token)."""
        if self.job_id is not None and self.worker_token is not None:
            status, answer = self._retrying("GET", f"/v1/jobs/{self.job_id}", None, self.timeout_s)
            if status != 200:
                raise PublisherError(f"job {self.job_id}: HTTP {status} {answer}")
            self.version = int(answer["version"])
            return
        status, answer = self._retrying("POST", "/v1/jobs", self.registration, self.timeout_s)
        if status != 201:
            raise PublisherError(f"registering the job: HTTP {status} {answer}")
        self.job_id, self.worker_token = answer["id"], answer["worker_token"]
        self.version = int(answer["version"])
        logger.info("job %s registered on %s (v%d)", self.job_id, self.base, self.version)

    def worker_args(self) -> list[str]:
        """See Publisher.worker_args."""
        assert self.job_id is not None and self.worker_token is not None, "start() first"
        # `--flag=value`: a value starting with "-" (url-safe tokens can) is not taken for a flag
        return [f"--service={self.base}", f"--job-id={self.job_id}", f"--token={self.worker_token}"]

    def report(self, kind: str, workers: Sequence[Worker], reason: str = "") -> Outcome:
        """Post the event now, or queue it (same event_id) while the service is unreachable."""
        self.seq += 1
        event_id = f"{self.run_id}-{self.seq}"
        event: dict[str, Any] = {
            "event_id": event_id,
            "kind": kind,
            "workers": [list(w) for w in sorted(workers)],
            "reason": reason or None,
        }
        self.outbox.append(event)
        outcomes = self._drain()
        return outcomes.get(event_id, Outcome(None))

    def flush(self) -> list[int]:
        """See Publisher.flush."""
        if not self.outbox:
            return []
        return sorted({s for o in self._drain().values() for s in o.lost_stages})

    def _drain(self) -> dict[str, Outcome]:
        """Send the outbox in order until it is empty or the service is unreachable."""
        outcomes: dict[str, Outcome] = {}
        while self.outbox:
            event = self.outbox[0]
            try:
                status, answer = self._call("POST", f"/v1/jobs/{self.job_id}/events", event)
            except OSError as e:
                logger.warning("event %s kept for later: service unreachable (%s)", event["event_id"], e)
                break
            if status >= 500:
                logger.warning("event %s kept for later: HTTP %d", event["event_id"], status)
                break
            self.outbox.pop(0)
            self.answers.append((status, answer))
            if status == 200:
                self.version = max(self.version, int(answer["version"]))
                outcomes[event["event_id"]] = Outcome(int(answer["version"]))
            elif status == 409 and answer.get("error") == "unrecoverable":
                logger.error("event %s: unrecoverable, stages %s lost", event["event_id"], answer["stages"])
                outcomes[event["event_id"]] = Outcome(None, [int(s) for s in answer["stages"]])
            else:
                raise PublisherError(f"event {event}: HTTP {status} {answer}")
            logger.info("event %s (%s %s): %s", event["event_id"], event["kind"], event["workers"], answer)
        return outcomes

    def finish(self) -> None:
        """Turn the job's heartbeat off, so that workers that finished and stopped polling are not
        declared failed (the service has no "finished" state); best effort."""
        self.flush()
        try:
            status, answer = self._call("PATCH", f"/v1/jobs/{self.job_id}", {"heartbeat_enabled": False})
        except OSError as e:
            logger.warning("job %s: could not turn its heartbeat off: %s", self.job_id, e)
            return
        if status != 200:
            logger.warning("job %s: turning its heartbeat off: HTTP %d %s", self.job_id, status, answer)

    def status(self) -> dict[str, Any]:
        """GET /v1/jobs/{id}."""
        status, answer = self._retrying("GET", f"/v1/jobs/{self.job_id}", None, self.timeout_s)
        if status != 200:
            raise PublisherError(f"job {self.job_id}: HTTP {status} {answer}")
        return answer

    def _deliver_by(self, deadline: float) -> None:
        """Deliver the outbox, retrying until `deadline` (monotonic seconds)."""
        self.flush()
        while self.outbox:
            if time.monotonic() > deadline:
                raise PublisherError(f"service unreachable: events {self.outbox} not delivered")
            time.sleep(0.2)
            self.flush()

    def restored(self) -> int:
        """Rejoin every worker the service has as failed, so that the job leaves needs_restore."""
        deadline = time.monotonic() + self.timeout_s
        self._deliver_by(deadline)
        doc = self.status()
        if doc["failed"]:
            self.report("rejoin", [(int(d), int(s)) for d, s in doc["failed"]], "restored from a checkpoint")
            self._deliver_by(deadline)
            doc = self.status()
        if doc["state"] != "running":
            raise PublisherError(f"job {self.job_id} is still {doc['state']} after the rejoin: {doc}")
        self.version = int(doc["version"])
        return self.version
