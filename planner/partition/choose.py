"""Plan a failure set with re-partition: choose the layer split and the re-routed schedule together.

1. The DP of planner/partition/search.py gives the least load bound over all partitions (kept in the
   figures as `best_load_bound_ms`, so the gap of the chosen plan to it stays visible) and a few
   candidate partitions near it: the DP's own, and the ones moving the fewest layers under the
   bound times (1 + 1e-6, 1.02, 1.05).
2. Candidates are ranked by the memory-aware bound of their derived job (planner.bounds), then by
   layers moved; the best `max_plans` are planned with planner.plan.plan on the derived job
   (stopping at one that meets its memory-aware bound). The job's own partition (re-route only)
   is planned too unless the best plan is already below its load bound.
3. The fastest validated schedule wins (ties: fewer layers moved). When no candidate lowers the
   load bound, or none plans faster than re-route only, the result is re-route only and says why.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from planner.bounds import load_bound, memory_bound
from planner.contract import FailureScenario, JobSpec, Migration
from planner.partition.derive import derive_job, migration
from planner.partition.layers import LayerModel, layer_model
from planner.partition.search import (
    best_partition,
    fewest_moves,
    partition_bound,
    stage_costs,
    unmeetable_stage,
)
from planner.plan import PlanResult, Progress, baseline_1f1b_ms, plan
from planner.simulator import validate

SLACKS = (1e-6, 0.02, 0.05)
MIN_GAIN = 1e-6  # relative: a re-partitioned plan must beat re-route only by more than this
GOOD_ENOUGH = 5e-4  # a candidate plan this close to its memory-aware bound ends the search


@dataclass
class Repartitioned:
    """The chosen plan (its schedule carries `partition` and `migration` unless it is re-route only)
    and the figures to judge the choice by."""

    result: PlanResult
    reroute: PlanResult | None  # None: not planned (its load bound is above the chosen plan)
    job_partition: list[list[int]]
    partition: list[list[int]]
    migration: Migration
    load_bound_ms: float  # of the chosen partition
    memory_bound_ms: float
    best_load_bound_ms: float  # over all partitions
    reroute_load_bound_ms: float
    layers_source: str
    bandwidth_source: str
    note: str
    planning_s: float
    planning_cpu_s: float
    candidates: list[dict[str, Any]] = field(default_factory=list)

    @property
    def iteration_time_ms(self) -> float:
        return self.result.iteration_time_ms

    @property
    def repartitioned(self) -> bool:
        return self.partition != self.job_partition

    def figures(self, job: JobSpec) -> dict[str, Any]:
        """The `repartition` block of `recycle plan --repartition --json`."""
        base = baseline_1f1b_ms(job)
        return {
            "repartitioned": self.repartitioned,
            "note": self.note,
            "partition": self.partition,
            "job_partition": self.job_partition,
            "layers_source": self.layers_source,
            "migration": {
                **self.migration.model_dump(mode="json"),
                "bandwidth_source": self.bandwidth_source,
            },
            "iteration_time_ms": self.iteration_time_ms,
            "reroute_only_ms": None if self.reroute is None else self.reroute.iteration_time_ms,
            "throughput_retained_vs_1f1b": base / self.iteration_time_ms if self.iteration_time_ms else 1.0,
            "load_bound_ms": self.load_bound_ms,
            "memory_bound_ms": self.memory_bound_ms,
            "best_load_bound_ms": self.best_load_bound_ms,
            "reroute_load_bound_ms": self.reroute_load_bound_ms,
            "gap_to_best_load_bound": self.iteration_time_ms / self.best_load_bound_ms - 1
            if self.best_load_bound_ms > 0
            else 0.0,
            "planning_s": self.planning_s,
            "planning_cpu_s": self.planning_cpu_s,
            "candidates": self.candidates,
        }


def candidate_partitions(
    job: JobSpec, scenario: FailureScenario, model: LayerModel
) -> tuple[float, float, list[list[list[int]]]]:
    """(best load bound over all partitions, the job partition's, candidate partitions other than the
    job's, best first by memory-aware bound). InvalidInputError when no partition fits in memory."""
    costs = stage_costs(job, model, scenario)
    best, found = best_partition(costs)
    if found is None:
        raise unmeetable_stage(costs, job)
    own = partition_bound(costs, model.partition)
    cands = [found]
    for slack in SLACKS:
        p = fewest_moves(costs, model, best * (1 + slack))
        if p is not None and p not in cands and partition_bound(costs, p) < own * (1 - MIN_GAIN):
            cands.append(p)
    cands = [p for p in cands if p != model.partition]

    def rank(p: list[list[int]]) -> tuple[float, int]:
        """Least memory-aware bound first (rounded to 1e-6 ms), then fewest layers moved."""
        mb = memory_bound(derive_job(job, p, model), scenario)
        moved = sum(
            1
            for s, (a, b) in enumerate(p)
            for x in range(a, b)
            if not model.partition[s][0] <= x < model.partition[s][1]
        )
        return round(mb, 6), moved

    return best, own, sorted(cands, key=rank)


def plan_repartition(
    job: JobSpec,
    scenario: FailureScenario,
    time_limit: timedelta | None = None,
    use_cpsat: bool = True,
    progress: Progress | None = None,
    max_plans: int = 2,
) -> Repartitioned:
    """Plan `scenario` on `job` choosing the partition too (see the module doc). Raises what
    planner.plan.plan raises, and InvalidInputError when the job has no per-layer figures or no
    partition fits in memory."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    scenario.check_against(job)
    model = layer_model(job)
    best, own, cands = candidate_partitions(job, scenario, model)
    chosen: PlanResult | None = None
    chosen_p, records = model.partition, []
    helps = bool(cands) and best < own * (1 - MIN_GAIN)
    for p in cands[:max_plans] if helps else []:
        derived = derive_job(job, p, model)
        res = plan(derived, scenario, time_limit=time_limit, use_cpsat=use_cpsat, progress=progress)
        bound = load_bound(derived, scenario)
        records.append({"partition": p, "load_bound_ms": bound, "iteration_time_ms": res.iteration_time_ms})
        if chosen is None or res.iteration_time_ms < chosen.iteration_time_ms * (1 - MIN_GAIN):
            chosen, chosen_p = res, p
            if res.iteration_time_ms <= res.memory_bound_ms * (1 + GOOD_ENOUGH):
                break  # at its own bound: the next candidate's bound is no lower
    reroute = None
    if chosen is None or chosen.iteration_time_ms >= own * (1 - MIN_GAIN):  # re-route could win
        reroute = plan(job, scenario, time_limit=time_limit, use_cpsat=use_cpsat, progress=progress)
        if chosen is None or reroute.iteration_time_ms <= chosen.iteration_time_ms * (1 - MIN_GAIN):
            chosen, chosen_p = reroute, model.partition
    assert chosen is not None
    if not helps:
        note = "re-route only: no partition lowers the load bound of the job's own partition"
    elif chosen is reroute:
        note = "re-route only: no re-partitioned plan was faster than re-routing on the job's partition"
    elif not math.isfinite(own):
        note = "re-partitioned: the job's own partition does not fit in memory"
    else:
        note = "re-partitioned: layers move to the stages with more alive workers, then re-routed"
        if reroute is None:
            note += " (re-route only not planned: its load bound is above this plan)"
    chosen.baseline_1f1b_ms = baseline_1f1b_ms(job)  # the job's failure-free 1F1B, not the derived one's
    mig = migration(job, chosen_p, model, scenario=scenario)
    schedule = chosen.schedule
    if chosen_p != model.partition:
        extra = schedule.__pydantic_extra__
        assert extra is not None
        extra["partition"] = chosen_p
        extra["migration"] = mig.model_dump(mode="json")
        chosen.report = validate(job, scenario, schedule)  # through the simulator's partition hook
    derived = derive_job(job, chosen_p, model)
    return Repartitioned(
        result=chosen,
        reroute=reroute,
        job_partition=model.partition,
        partition=chosen_p,
        migration=mig,
        load_bound_ms=load_bound(derived, scenario),
        memory_bound_ms=memory_bound(derived, scenario),
        best_load_bound_ms=best,
        reroute_load_bound_ms=own,
        layers_source=model.source,
        bandwidth_source=model.bandwidth_source,
        note=note,
        planning_s=time.perf_counter() - t0,
        planning_cpu_s=time.process_time() - cpu0,
        candidates=records,
    )
