"""`recycle plan --repartition`: the planner call and the lines it adds to the summary."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from planner.contract import FailureScenario, JobSpec
from planner.partition.choose import plan_repartition
from planner.partition.derive import derive_job
from planner.plan import PlanResult, Progress


def plan_with_repartition(
    job: JobSpec, scenario: FailureScenario, limit: timedelta, use_cpsat: bool, progress: Progress
) -> tuple[PlanResult, JobSpec, dict[str, Any]]:
    """(the chosen plan, the stage-level job it runs, the `repartition` figures)."""
    rep = plan_repartition(job, scenario, time_limit=limit, use_cpsat=use_cpsat, progress=progress)
    return rep.result, derive_job(job, rep.partition), rep.figures(job)


def _ranges(partition: list[list[int]]) -> str:
    """`0:[0,5) 1:[5,5)=none ...`: a stage with no layer only passes activations through."""
    return " ".join(f"{s}:[{a},{b})" + ("=none" if a == b else "") for s, (a, b) in enumerate(partition))


def _reroute(fig: dict[str, Any]) -> str:
    if fig["reroute_only_ms"] is not None:
        return f"{fig['reroute_only_ms']:.3f}"
    return f"not planned (its load bound {fig['reroute_load_bound_ms']:.3f} is above this plan)"


def render_repartition(fig: dict[str, Any]) -> str:
    """The re-partition block printed under the plan summary."""
    mig = fig["migration"]
    moves = ", ".join(
        f"layers [{m['layers'][0]},{m['layers'][1]}) stage {m['from_stage']}->{m['to_stage']}"
        for m in mig["moves"]
    )
    rows = [
        ("re-partition", fig["note"]),
        ("partition (stage:[first,end))", _ranges(fig["partition"])),
        ("job's partition", _ranges(fig["job_partition"])),
        ("per-layer figures", fig["layers_source"]),
        ("re-route only (ms)", _reroute(fig)),
        ("load bound, chosen partition (ms)", f"{fig['load_bound_ms']:.3f}"),
        ("load bound, best over all partitions (ms)", f"{fig['best_load_bound_ms']:.3f}"),
        ("load bound, job's partition (ms)", f"{fig['reroute_load_bound_ms']:.3f}"),
        ("gap to best bound over partitions", f"{fig['gap_to_best_load_bound']:.2%}"),
        ("migration", moves or "none"),
        (
            "migration estimate",
            f"{mig['mib']:.1f} MiB per pipeline, {mig['estimated_ms']:.1f} ms "
            f"(link bandwidth {mig['bandwidth_source']})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
