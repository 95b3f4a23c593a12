"""Re-partition (issue 12): per-layer figures, the stage-level job of a layer split, and the planner
that chooses the split and the re-routed schedule together for a failure set."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.contract import JobSpec, Schedule
from planner.partition.derive import derive_job, migration
from planner.partition.layers import LayerModel, default_partition, layer_model

if TYPE_CHECKING:
    from planner.partition.choose import Repartitioned


def job_for_schedule(job: JobSpec, schedule: Schedule) -> JobSpec:
    """The job a schedule runs: `job` itself, or derive_job(job, schedule's partition) when it
    carries one (the simulator's hook)."""
    part = schedule.partition_ranges()
    return job if part is None else derive_job(job, part)


def plan_repartition(*args: object, **kwargs: object) -> Repartitioned:
    """planner.partition.choose.plan_repartition (imported lazily: it pulls in the planner)."""
    from planner.partition.choose import plan_repartition as run

    return run(*args, **kwargs)  # type: ignore[arg-type]


__all__ = [
    "LayerModel",
    "default_partition",
    "derive_job",
    "job_for_schedule",
    "layer_model",
    "migration",
    "plan_repartition",
]
