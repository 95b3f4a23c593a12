"""Tiny job specs shared by the tests: every stage the same profile."""

from __future__ import annotations

from planner.contract import JobSpec


def uniform_job(
    D: int,
    P: int,
    M: int,
    *,
    op_ms: float = 1.0,
    optimizer_ms: float = 1.0,
    activation_mib: float = 100.0,
    weight_grad_mib: float = 30.0,
    capacity_mib: float | None = None,
    allreduce_ms: float = 0.0,
    activation_ms: float = 0.0,
    cross_pipeline_ms: float = 0.0,
    name: str = "tiny",
) -> JobSpec:
    """D pipelines x P stages x M micro-batches; F, B and W each take `op_ms` (hops free by default)."""
    stage = {
        "forward": op_ms,
        "backward_input": op_ms,
        "backward_weight": op_ms,
        "optimizer": optimizer_ms,
        "activation_mib": activation_mib,
        "weight_grad_mib": weight_grad_mib,
    }
    return JobSpec.model_validate(
        {
            "name": name,
            "num_pipelines": D,
            "num_stages": P,
            "num_microbatches": M,
            "stages": [stage] * P,
            "comm": {
                "activation_ms": activation_ms,
                "cross_pipeline_ms": cross_pipeline_ms,
                "allreduce_ms": allreduce_ms,
            },
            "memory_capacity_mib": capacity_mib,
        }
    )
