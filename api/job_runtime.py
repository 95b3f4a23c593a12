"""A job's in-memory state and the small pure pieces of the job service (api/jobs.py): token hashing,
event answers, the done rule, and a plan picked for a scenario before it is published."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any

from api.store import JobRecord
from api.views import VersionView
from planner.contract import FailureScenario, JobSpec

Worker = tuple[int, int]

# A heartbeat poll (the job's worker token, `worker=d,s`) waits at most this fraction of the job's
# heartbeat timeout, so a healthy worker's next poll arrives well within the timeout: liveness comes
# only from requests arriving, never from a poll left parked on an open socket.
POLL_WAIT_FRACTION = 1 / 3


def hash_token(token: str) -> str:
    """What the store keeps of a worker token."""
    return hashlib.sha256(token.encode()).hexdigest()


def event_result(
    job_id: str, event_id: str, version: int, state: str, source: str | None, scenario: FailureScenario,
    lost_stages: list[int],
) -> dict[str, object]:  # fmt: skip
    """The answer to an event (`changed` False: the caller sets it when the event made a version)."""
    result: dict[str, object] = {
        "event_id": event_id, "job_id": job_id, "version": version, "state": state, "source": source,
        "failed": [list(w) for w in scenario.failed], "changed": False, "replayed": False,
    }  # fmt: skip
    if lost_stages:
        result["unrecoverable_stages"] = lost_stages
    return result


@dataclass
class Plan:
    """A schedule picked for a scenario, not yet published."""

    json: str
    source: str
    itime: float
    refine: bool  # not refined by CP-SAT yet
    schedule: dict[str, Any] | None = None  # `json` parsed, when at hand


def all_done(job: JobSpec, failed: set[Worker], done: set[Worker]) -> bool:
    """True when every alive worker of `job` (not in `failed`) is in `done`, and some worker is alive."""
    alive = job.num_pipelines * job.num_stages - len(failed)
    return alive > 0 and len(done - failed) == alive


@dataclass
class JobRuntime:
    """In-memory state of one job; the store is the source of truth, this is its published view."""

    record: JobRecord
    job: JobSpec
    scenario: FailureScenario
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    view: VersionView | None = None
    scenario_seq: int = 0
    last_seen: dict[Worker, float] = field(default_factory=dict)  # arrival of each worker's last poll
    # The restore grace's stand-in arrival in `last_seen` (api/job_events.py): while every tracked worker
    # still holds it, no worker came back after the restore and none is declared failed.
    restore_until: float | None = None
    precompute_failed: int = 0  # keys given up by this run's precompute (api/background.py)
    closing: bool = False  # the service is shutting down: parked long-polls end (api/jobs.py begin_stop)
    done: set[Worker] = field(default_factory=set)  # alive workers that reported `done`

    def expect_every_worker(self, until: float) -> None:
        """Count every alive, not done worker as seen at `until` (after a restore or a restart of the
        service: the time they have to come back and poll, api/background.py)."""
        failed = {(int(d), int(s)) for d, s in self.scenario.failed}
        self.last_seen = {
            (d, s): until
            for d in range(self.job.num_pipelines)
            for s in range(self.job.num_stages)
            if (d, s) not in failed and (d, s) not in self.done
        }
        self.restore_until = until

    def restart_clocks(self, first_poll: float) -> None:
        """A worker polled after `expect_every_worker`: the workers not seen since count as seen at
        `first_poll`, or at the end of the wait if later, and the wait is over (api/background.py)."""
        until = self.restore_until
        if until is None:
            return
        start = max(first_poll, until)
        for w, seen in self.last_seen.items():
            if seen == until:
                self.last_seen[w] = start
        self.restore_until = None

    @property
    def version(self) -> int:
        return self.record.version
