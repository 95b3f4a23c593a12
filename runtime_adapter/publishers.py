"""Where the launcher publishes failure-set changes: a schedule file, or the planner service.

`FilePublisher` keeps the failure set itself and writes the schedule of each new set (from
`schedule_for`: the planner in tests, a directory of precomputed schedules on the CLI) as the next
version of the file the workers poll. `ServicePublisher` is the controller of a job on the service:
it registers the job (or attaches to one), posts `fail` / `rejoin` events with unique event_ids, and
lets the service pick and version the schedules that the workers long-poll. Events the service
could not take (unreachable, 5xx) wait in an outbox and are re-sent with the same event_id, which
the service applies once (service_publisher.py; still importable from here).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from planner.contract import JobSpec, Schedule
from runtime_adapter.assignment import Worker

if TYPE_CHECKING:
    from runtime_adapter.service_publisher import ServicePublisher as ServicePublisher

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


def __getattr__(name: str) -> Any:
    """`ServicePublisher` lives in service_publisher.py (which imports this module)."""
    if name == "ServicePublisher":
        from runtime_adapter.service_publisher import ServicePublisher

        return ServicePublisher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
