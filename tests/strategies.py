"""Hypothesis strategies for small random jobs and recoverable failure sets."""

from __future__ import annotations

from hypothesis import strategies as st

from planner.contract import FailureScenario, JobSpec


@st.composite
def small_jobs(
    draw: st.DrawFn, max_d: int = 3, max_p: int = 4, max_m: int = 5, memory: bool = True
) -> JobSpec:
    D = draw(st.integers(1, max_d))
    P = draw(st.integers(1, max_p))
    M = draw(st.integers(1, max_m))
    t = st.floats(0.5, 5.0, allow_nan=False).map(lambda x: round(x, 3))
    stages = [
        {
            "forward": draw(t),
            "backward_input": draw(t),
            "backward_weight": draw(t),
            "optimizer": draw(t),
            "activation_mib": 100.0,
            "weight_grad_mib": draw(st.sampled_from([10.0, 30.0, 60.0, 150.0])),  # above: B grows memory
        }
        for _ in range(P)
    ]
    cap = None
    if memory and draw(st.booleans()):
        cap = 100.0 * draw(st.integers(1, 2 * P)) + 60.0
    return JobSpec.model_validate(
        {
            "name": "rand",
            "num_pipelines": D,
            "num_stages": P,
            "num_microbatches": M,
            "stages": stages,
            "comm": {
                "activation_ms": draw(st.sampled_from([0.0, 0.05, 0.3])),
                "cross_pipeline_ms": draw(st.sampled_from([0.0, 0.1, 0.6])),
                "allreduce_ms": draw(st.sampled_from([0.0, 0.4, 2.0])),
            },
            "memory_capacity_mib": cap,
        }
    )


@st.composite
def recoverable_scenarios(
    draw: st.DrawFn, job: JobSpec, max_failures: int = 3, slow: bool = True
) -> FailureScenario:
    """Failure sets that leave every stage at least one alive worker (optionally a slow worker)."""
    D, P = job.num_pipelines, job.num_stages
    workers = [(d, s) for d in range(D) for s in range(P)]
    chosen = draw(st.lists(st.sampled_from(workers), max_size=max_failures, unique=True))
    failed: list[tuple[int, int]] = []
    for d, s in chosen:
        if sum(1 for _, ss in failed if ss == s) + 1 < D:
            failed.append((d, s))
    slow_list = []
    alive = [w for w in workers if w not in failed]
    if slow and alive and draw(st.booleans()):
        w = draw(st.sampled_from(alive))
        slow_list.append({"worker": w, "factor": draw(st.sampled_from([1.25, 1.5, 2.0]))})
    return FailureScenario.model_validate({"failed": failed, "slow": slow_list})
