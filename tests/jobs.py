"""Tiny job specs shared by the tests (every stage the same profile), and two helpers of the process
tests: the inputs of a launch, waiting for processes to be gone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


SERVICE_PROFILE = {"optimizer_ms": 0.5, "activation_mib": 10.0, "weight_grad_mib": 5.0, "allreduce_ms": 0.4,
                   "activation_ms": 0.05, "cross_pipeline_ms": 0.2}  # fmt: skip


def service_job(D: int, P: int, M: int) -> JobSpec:
    """The service tests' job: 1 ms ops, 0.5 ms optimizer, real hop and all-reduce times."""
    return uniform_job(D, P, M, name=f"tiny-d{D}p{P}", **SERVICE_PROFILE)  # type: ignore[arg-type]


def service_job_doc(D: int, P: int, M: int) -> dict[str, Any]:
    """`service_job` as the JSON document a client posts."""
    return service_job(D, P, M).model_dump(mode="json", exclude_none=True)


def tiny_job(num_pipelines: int, num_stages: int, num_microbatches: int = 4) -> JobSpec:
    """A job spec for the runtime's reference model (the profile only steers the planner's orders)."""
    return uniform_job(
        num_pipelines,
        num_stages,
        num_microbatches,
        optimizer_ms=0.5,
        activation_mib=1.0,
        weight_grad_mib=1.0,
        allreduce_ms=0.4,
        activation_ms=0.05,
        cross_pipeline_ms=0.2,
        name=f"tiny-d{num_pipelines}p{num_stages}",
    )


def wait_gone(pids: list[int], within_s: float) -> bool:
    """True once none of `pids` is a running process (within `within_s` seconds); else False, after
    killing the ones left (no test leaves a process behind)."""
    import os
    import signal
    import time

    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return False


def precomputed_inputs(base: Path, job: JobSpec) -> tuple[str, str]:
    """`base`/job.json and the plans of up to one failure in `base`/plans: a launch's --job and
    --schedules."""
    from whatif.cache import PlanCache
    from whatif.precompute import precompute

    (base / "job.json").write_text(job.model_dump_json())
    precompute(job, 1, PlanCache(base / "plans"), num_workers=1, progress=False)
    return str(base / "job.json"), str(base / "plans")
