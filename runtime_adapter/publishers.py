"""Where the launcher publishes failure-set changes: a schedule file, or the planner service.

`FilePublisher` keeps the failure set itself and writes the schedule of each new set (from
`schedule_for`: the planner in tests, a directory of precomputed schedules on the CLI) as the next
version of the file the workers poll. When a failure set loses a whole stage and checkpointing is on,
it publishes a restore version instead (every worker alive, the failure-free schedule, and
`restore: {epoch, iteration}` with the newest complete checkpoint of its checkpoint directory or null),
the same protocol the service follows (docs/runtime.md, "Restores"). `ServicePublisher` is the
controller of a job on the service (or an agent attached to it with the job's worker token): it
registers the job (or attaches to one), posts `fail` / `rejoin` events with unique event_ids, follows
the job's versions (restores) and lets the service pick and version the schedules that the workers
long-poll. Events the service could not take (unreachable, 5xx) wait in an outbox and are re-sent
with the same event_id, which the service applies once (service_publisher.py; still importable from
here).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from planner.contract import JobSpec, Schedule
from planner.errors import InvalidInputError
from runtime_adapter.assignment import Worker, parse_restore
from runtime_adapter.heartbeats import DEFAULT_TIMEOUT_S, Watch

if TYPE_CHECKING:
    from runtime_adapter.service_publisher import ServicePublisher as ServicePublisher

MAX_VERSION = 2**53  # the largest schedule version a resumed file may hold (exact in every JSON reader)

logger = logging.getLogger(__name__)

ScheduleFor = Callable[[frozenset[Worker]], Schedule]


def lost_stages(failed: frozenset[Worker] | set[Worker], num_pipelines: int, num_stages: int) -> list[int]:
    """Stages whose every worker is in `failed` (the failure set is then unrecoverable)."""
    return [s for s in range(num_stages) if all((d, s) in failed for d in range(num_pipelines))]


@dataclass(frozen=True)
class Restore:
    """A version's `restore` field: every worker takes restore epoch `epoch`, loading the checkpoint at
    stepped count `iteration` (None: the initial parameters); `version` is the first version with it."""

    epoch: int
    iteration: int | None
    version: int = 0

    def field(self) -> dict[str, int | None]:
        """The envelope's `restore` object."""
        return {"epoch": self.epoch, "iteration": self.iteration}

    @classmethod
    def from_envelope(cls, doc: dict[str, Any]) -> Restore | None:
        """The `restore` of a version envelope (None when absent: no restore yet)."""
        r = parse_restore(doc)
        return None if r is None else cls(r.epoch, r.iteration, int(doc.get("version", 0)))


def publish(
    path: Path,
    version: int,
    schedule: Schedule,
    state: str = "running",
    restore: Restore | dict[str, int | None] | None = None,
    restore_policy: str | None = None,
    joined_at: Mapping[str, int] | None = None,
) -> None:
    """Atomically replace the schedule file with version `version`, with the restore protocol's optional
    fields when given: `restore` (a Restore or the {"epoch", "iteration"} object itself),
    `restore_policy` ("auto": the publisher restores by itself) and `joined_at` ({"d,s": version} of
    every alive worker: fencing)."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    doc: dict[str, Any] = {
        "version": version,
        "state": state,
        "schedule": json.loads(schedule.model_dump_json(exclude_none=True)),
    }
    if restore is not None:
        doc["restore"] = restore.field() if isinstance(restore, Restore) else dict(restore)
    if restore_policy is not None:
        doc["restore_policy"] = restore_policy
    if joined_at is not None:
        doc["joined_at"] = dict(joined_at)
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


class RegistrationRefused(PublisherError):
    """The service answered the job's registration with a 4xx: the launch's input is wrong (exit 2)."""


def refusal_text(status: int, answer: object) -> str:
    """A service's 4xx answer as one line: its `detail` (FastAPI's field list joined), else as sent."""
    detail = answer.get("detail", answer) if isinstance(answer, dict) else answer
    if isinstance(detail, list):  # a request validation error: [{"loc": [...], "msg": ...}, ...]
        detail = "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}"
            if isinstance(d, dict)
            else str(d)
            for d in detail
        )
    return f"HTTP {status}: {detail}"


class Publisher(Protocol):
    """What the launcher needs from a schedule publisher."""

    version: int

    def start(self) -> None:
        """Publish version 1 (the failure-free schedule)."""
        ...

    def worker_args(self) -> list[str]:
        """Command-line flags telling a worker where to poll."""
        ...

    def report(
        self, kind: str, workers: Sequence[Worker], reason: str = "", event_id: str | None = None
    ) -> Outcome:
        """Report workers failed (`fail`) or back (`rejoin`); `event_id` (default: a fresh one) makes
        a retry idempotent."""
        ...

    def flush(self) -> list[int]:
        """Re-send what could not be delivered yet (called on every supervision tick); the stages
        lost if a delivered event turned out unrecoverable. Raises PublisherError when the source
        refused us for good."""
        ...

    def restore_lost(self, left: Sequence[tuple[Worker, str]], reason: str) -> Outcome:
        """The job's state is lost although no stage lost every worker (`reason`: e.g. a layer to
        migrate without a live holder; `left`: the workers that left for it, each with the event_id
        of its exit): publish a restore from the newest complete checkpoint, as for a lost stage."""
        ...

    def latest_restore(self) -> Restore | None:
        """The newest restore published (None: none yet)."""
        ...

    def fenced(self) -> frozenset[Worker]:
        """The workers the controller declared failed by itself, whose processes may still run (the
        service's heartbeat failed them: hung, stopped, partitioned)."""
        ...

    def silent(self, running: Mapping[Worker, int]) -> list[Worker]:
        """The workers of `running` (worker -> pid) that stopped polling for the heartbeat timeout and
        that only the launcher can tell (a schedule file: heartbeats.py); the service tells its own
        through `fenced`."""
        ...

    def finish(self) -> None:
        """The job is over (every worker exited)."""
        ...


class FilePublisher:
    """A schedule file `{"version", "state", "schedule", "joined_at"[, "restore_policy", "restore"]}`
    replaced atomically on each change. With `checkpoints` (a checkpoint directory) a lost stage
    publishes a restore version, and every version says `"restore_policy": "auto"`.

    `joined_at` ({"d,s": version} of every alive worker, the same incarnations the service tracks):
    1 at the start, the re-join version for a re-joiner, the restore version for everyone after a
    restore; a worker process that finds itself alive since another version than the one it joined
    at was replaced meanwhile and leaves (fencing, incarnation.py)."""

    def __init__(
        self,
        path: Path,
        job: JobSpec,
        schedule_for: ScheduleFor,
        checkpoints: Path | str | None = None,
        heartbeat_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.path, self.job, self.schedule_for = Path(path), job, schedule_for
        self.checkpoints = checkpoints
        self.heartbeats = self.path.parent / "heartbeats"  # the workers' files (heartbeats.py)
        self.watch = Watch(self.heartbeats, heartbeat_timeout_s)
        self.failed: set[Worker] = set()
        self.version = 0
        self.restore: Restore | None = None
        self.joined: dict[str, int] = {}  # the last published `joined_at`
        self._resuming = False

    def _publish(self, restore: bool = False) -> int:
        # The schedule first: a failure set without a plan raises before any version is counted (the
        # launcher printed "schedule now v3" and "last schedule v3" for a v3 never published).
        schedule = self.schedule_for(frozenset(self.failed))
        self.version += 1
        alive = [(d, s) for d in range(self.job.num_pipelines) for s in range(self.job.num_stages)
                 if (d, s) not in self.failed]  # fmt: skip
        before = {} if restore else self.joined  # a restore version: everyone joins anew
        self.joined = {k: before.get(k, self.version) for k in (f"{d},{s}" for d, s in alive)}
        policy = "auto" if self.checkpoints is not None else None
        publish(self.path, self.version, schedule, restore=self.restore, restore_policy=policy,
                joined_at=self.joined)  # fmt: skip
        logger.info("published schedule v%d for failed %s", self.version, sorted(self.failed))
        return self.version

    def _publish_restore(self) -> int:
        """Every worker alive again, restore epoch + 1 from the newest complete checkpoint."""
        from runtime_adapter import checkpoint

        assert self.checkpoints is not None
        k = checkpoint.latest_complete(self.checkpoints, self.job.num_stages)  # type: ignore[arg-type]
        self.failed.clear()
        epoch = 1 if self.restore is None else self.restore.epoch + 1
        self.restore = Restore(epoch, k, self.version + 1)
        logger.warning("restore epoch %d from %s", epoch, "scratch" if k is None else f"iteration {k}")
        return self._publish(restore=True)

    def resume(self) -> None:
        """Go on from the schedule file an earlier launcher of this job left (killed, or stopped):
        `start` then publishes a restore version (its restore epoch + 1, from the newest complete
        checkpoint; the initial parameters without one) numbered after the file's, so everything the
        earlier processes wrote is of an older version. Needs the checkpoint directory; an unreadable
        file is an InvalidInputError."""
        assert self.checkpoints is not None, "resume needs the checkpoint directory"
        try:
            doc = json.loads(self.path.read_text())
            version = doc["version"]
            restore = Restore.from_envelope(doc)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidInputError(f"--resume: {self.path} is not a launch's schedule file ({e})") from None
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= MAX_VERSION:
            raise InvalidInputError(f"--resume: {self.path}: version {version!r} is not a version number")
        self.version, self.restore, self._resuming = version, restore, True

    def start(self) -> None:
        """See Publisher.start (after `resume`: the restore version)."""
        if self._resuming:
            self._publish_restore()
        else:
            self._publish()

    def worker_args(self) -> list[str]:
        """See Publisher.worker_args."""
        return ["--schedule-file", str(self.path), "--heartbeat-dir", str(self.heartbeats)]

    def fenced(self) -> frozenset[Worker]:
        """None: a schedule file fails only the workers the launcher reported."""
        return frozenset()

    def silent(self, running: Mapping[Worker, int]) -> list[Worker]:
        """See Publisher.silent: heartbeat files older than the timeout."""
        return self.watch.silent(running)

    def report(
        self, kind: str, workers: Sequence[Worker], reason: str = "", event_id: str | None = None
    ) -> Outcome:
        """See Publisher.report. An unrecoverable set publishes a restore version when checkpointing
        is on (the outcome names the lost stages either way), else nothing."""
        if kind == "fail":
            self.failed.update(workers)
        elif kind == "rejoin":
            self.failed.difference_update(workers)
        lost = lost_stages(frozenset(self.failed), self.job.num_pipelines, self.job.num_stages)
        if lost:
            return Outcome(self._publish_restore() if self.checkpoints is not None else None, lost)
        return Outcome(self._publish())

    def restore_lost(self, left: Sequence[tuple[Worker, str]], reason: str) -> Outcome:
        """See Publisher.restore_lost: the restore version (nothing without a checkpoint directory)."""
        if self.checkpoints is None:
            return Outcome(None)
        logger.warning("%s: the job's state is lost", reason)
        return Outcome(self._publish_restore())

    def flush(self) -> list[int]:
        """Nothing is ever pending."""
        return []

    def latest_restore(self) -> Restore | None:
        """See Publisher.latest_restore."""
        return self.restore

    def finish(self) -> None:
        """Nothing to do."""


def __getattr__(name: str) -> Any:
    """`ServicePublisher` lives in service_publisher.py (which imports this module)."""
    if name == "ServicePublisher":
        from runtime_adapter.service_publisher import ServicePublisher

        return ServicePublisher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
