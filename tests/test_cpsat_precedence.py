"""CP-SAT precedence family: dependencies and hop delays hold in the extracted times.

Also home of the tiny jobs the other test_cpsat_* files share.
"""

from __future__ import annotations

import datetime

from planner.contract import FailureScenario, JobSpec
from planner.cpsat import SolveStatus
from planner.cpsat.build import BuildOptions, build_model
from planner.cpsat.extract import extract_starts_ms
from planner.cpsat.solve import solve
from planner.problem import Problem

LIMIT = datetime.timedelta(seconds=5)


def tiny_job(
    d: int = 2, p: int = 2, m: int = 2, capacity: float | None = None, allreduce: float = 1.0
) -> JobSpec:
    """D x P pipelines, M micro-batches, integer-ish profiles, hops 0.5 (same) / 1.5 (cross)."""
    stage = {
        "forward": 1.0,
        "backward_input": 2.0,
        "backward_weight": 1.5,
        "optimizer": 0.5,
        "activation_mib": 100.0,
        "weight_grad_mib": 30.0,
    }
    return JobSpec.model_validate(
        {
            "name": "tiny",
            "num_pipelines": d,
            "num_stages": p,
            "num_microbatches": m,
            "stages": [stage] * p,
            "comm": {"activation_ms": 0.5, "cross_pipeline_ms": 1.5, "allreduce_ms": allreduce},
            "memory_capacity_mib": capacity,
        }
    )


def tiny_problem(failed: list[tuple[int, int]] | None = None, **kw: object) -> Problem:
    """Problem of `tiny_job(**kw)` with `failed` workers."""
    return Problem.build(tiny_job(**kw), FailureScenario(failed=failed or []))  # type: ignore[arg-type]


def test_dependencies_and_hops_hold_in_extracted_times() -> None:
    prob = tiny_problem(failed=[(1, 1)], p=3)
    v = build_model(prob, BuildOptions(horizon_ms=200.0))
    res = solve(v, datetime.timedelta(seconds=2))
    assert res.status.has_solution()
    start = extract_starts_ms(v, res.solver)
    host = prob.host
    dur = {"F": 1.0, "B": 2.0, "W": 1.5}
    at = {(k[1], k[2], k[3]): t for k, t in start.items() if k[2] is not None}
    eps = 1e-9
    for (s, mb, op), t in at.items():
        if op == "F" and s > 0:
            hop = prob.hop_ms(host[s - 1, mb[0], mb[1]], host[s, mb[0], mb[1]])
            assert t >= at[s - 1, mb, "F"] + dur["F"] + hop - eps
        if op == "B" and s < 2:
            hop = prob.hop_ms(host[s + 1, mb[0], mb[1]], host[s, mb[0], mb[1]])
            assert t >= at[s + 1, mb, "B"] + dur["B"] + hop - eps
        if op == "B" and s == 2:
            assert t >= at[s, mb, "F"] + dur["F"] - eps
        if op == "W":
            assert t >= at[s, mb, "B"] + dur["B"] - eps
    # the re-routed micro-batches of [1, 1] pay the cross-pipeline hop both ways
    assert any(host[1, 1, m] == 0 for m in range(2))


def test_period_below_one_micro_batch_round_trip_is_infeasible() -> None:
    # D=1, M=1: the load bound is one F+B+W + allreduce + OPT, but stage 0's window must also
    # hold the round trip through stage 1 (F, hop, F, B, hop) between its F and its B.
    prob = tiny_problem(d=1, m=1)
    load = 1.0 + 2.0 + 1.5 + 1.0 + 0.5
    round_trip = 1.0 + 0.5 + 1.0 + 2.0 + 0.5 + 2.0 + 1.5 + 1.0 + 0.5
    v = build_model(prob, BuildOptions(horizon_ms=100.0, lower_bound_ms=load, max_period_ms=round_trip - 0.1))
    assert solve(v, LIMIT).status is SolveStatus.INFEASIBLE
    v = build_model(prob, BuildOptions(horizon_ms=100.0, lower_bound_ms=load, max_period_ms=round_trip))
    res = solve(v, LIMIT)
    assert res.status is SolveStatus.OPTIMAL
    assert res.objective == round_trip * v.timing.scale
