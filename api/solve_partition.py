"""The service's re-partition plans (issue 12): what a job registered with `repartition: true` plans.

- `plan_key`: the plan-store key of a scenario's plan. Re-partitioned plans are stored under the
  normalized key plus REPARTITION_SUFFIX, so a job planning with re-partition and one planning
  re-route only (the same spec: the same normalized key) never share a plan.
- `plan_for_service`: with `partition=None` the partition is chosen with the schedule
  (planner.partition.plan_repartition: greedy for an event, CP-SAT for the precompute); with a
  partition given (the CP-SAT refinement of a plan already published), that partition's derived job
  (planner.partition.derive_job) is planned and the schedule keeps its `partition` and `migration`.
  A partition equal to the job's own plans the job itself: a re-route-only schedule, no fields.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from planner.contract import FailureScenario, JobSpec
from planner.partition import derive_job, layer_model, migration, plan_repartition

if TYPE_CHECKING:
    from api.records import JobRecord
    from planner.plan import PlanResult

REPARTITION_SUFFIX = "-rp"
REPARTITION_PLANS = 3  # plan_repartition plans at most max_plans (2) candidates and re-route only


def plan_key(key: str, repartition: bool) -> str:
    """The plan-store key of normalized key `key` for a job that plans with(out) re-partition."""
    return f"{key}{REPARTITION_SUFFIX}" if repartition else key


def solve_mode(rec: JobRecord) -> tuple[bool, ...]:
    """The arguments api/solver.py's solve() takes after `use_cpsat` for this job's event and
    precompute plans: none for a re-route-only job (its calls are as before), `repartition=True`."""
    return (True,) if rec.repartition else ()


def own_partition(job: JobSpec) -> str:
    """The job's own layer split as JSON (what a refinement of a re-route-only plan keeps)."""
    return json.dumps(layer_model(job).partition)


def check_repartition(job: JobSpec) -> None:
    """InvalidInputError (naming `layers`) unless `job` has per-layer figures to re-partition by."""
    layer_model(job)


def schedule_partition(schedule_json: str | None, schedule: dict[str, Any] | None = None) -> str | None:
    """The `partition` of a schedule document as JSON (None when it runs the job's own split)."""
    doc = schedule if schedule is not None else json.loads(schedule_json or "{}")
    part = doc.get("partition")
    return None if part is None else json.dumps(part)


def plan_for_service(
    job: JobSpec,
    scenario: FailureScenario,
    time_limit: timedelta,
    use_cpsat: bool,
    partition_json: str | None,
) -> tuple[PlanResult, dict[str, Any]]:
    """(the plan, its `repartition` figures) for a job that plans with re-partition (module doc)."""
    from planner.plan import baseline_1f1b_ms, plan
    from planner.simulator import validate

    if partition_json is None:
        rep = plan_repartition(job, scenario, time_limit=time_limit, use_cpsat=use_cpsat)
        return rep.result, rep.figures(job)
    model = layer_model(job)
    part = [[int(a), int(b)] for a, b in json.loads(partition_json)]
    derived = derive_job(job, part, model)
    result = plan(derived, scenario, time_limit=time_limit, use_cpsat=use_cpsat)
    result.baseline_1f1b_ms = baseline_1f1b_ms(job)
    mig = migration(job, part, model, scenario=scenario)
    if part != model.partition:
        extra = result.schedule.__pydantic_extra__
        assert extra is not None
        extra["partition"] = part
        extra["migration"] = mig.model_dump(mode="json")
        result.report = validate(job, scenario, result.schedule)  # through the partition hook
    figures = {
        "repartitioned": part != model.partition,
        "note": "refined on the published plan's partition",
        "partition": part,
        "job_partition": model.partition,
        "migration": mig.model_dump(mode="json"),
    }
    return result, figures
