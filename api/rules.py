"""Pure input rules of the service: job size bounds, and how an event changes a failure scenario."""

from __future__ import annotations

from api.models import EventIn
from api.settings import Settings
from planner.contract import FailureScenario, JobSpec, SlowWorker
from planner.errors import InvalidInputError


def check_dimensions(job: JobSpec, settings: Settings) -> None:
    """Refuse job specs too large to plan: D*P workers and D*P*M micro-batch slots are bounded."""
    d, p, m = job.num_pipelines, job.num_stages, job.num_microbatches
    if d * p > settings.max_workers_per_job:
        raise InvalidInputError(f"job has {d * p} workers (D*P); the limit is {settings.max_workers_per_job}")
    if d * p * m > settings.max_ops_per_job:
        raise InvalidInputError(f"job has D*P*M = {d * p * m}; the limit is {settings.max_ops_per_job}")


def apply_change(scenario: FailureScenario, event: EventIn, job: JobSpec) -> FailureScenario:
    """The failure scenario after `event` (pure). Raises InvalidInputError for workers off the grid.

    A `done` or `checkpoint` event leaves the scenario as it is (the service records done workers and
    reported checkpoints beside it)."""
    for i, (d, s) in enumerate(event.workers):
        if d >= job.num_pipelines or s >= job.num_stages:
            raise InvalidInputError(
                f"workers[{i}]: worker [{d}, {s}] is outside the job's grid "
                f"({job.num_pipelines} pipelines x {job.num_stages} stages)"
            )
    if event.kind in ("done", "checkpoint"):
        return scenario
    targets = {(int(d), int(s)) for d, s in event.workers}
    failed = {(int(d), int(s)) for d, s in scenario.failed}
    slow = {(int(w.worker[0]), int(w.worker[1])): float(w.factor) for w in scenario.slow}
    if event.kind == "fail":
        failed |= targets
        for w in targets:
            slow.pop(w, None)
    elif event.kind == "rejoin":
        failed -= targets
    else:
        dead = sorted(targets & failed)
        if dead:
            raise InvalidInputError(f"worker {list(dead[0])} is failed; rejoin it before marking it slow")
        for w in targets:
            if event.factor == 1.0:
                slow.pop(w, None)
            else:
                slow[w] = float(event.factor or 1.0)
    return FailureScenario(
        failed=sorted(failed), slow=[SlowWorker(worker=w, factor=f) for w, f in sorted(slow.items())]
    )
