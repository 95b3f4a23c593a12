"""Profiler, communication half: the activation hop and the stage all-reduces (gloo between threads of
this process on loopback), and the job spec and table from a profile (profile.py measures the stages).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from planner.contract import JobSpec
from runtime_adapter.profile import GLOO_TIMEOUT, StageMeasurement


@dataclass(frozen=True)
class CommMeasurement:
    """Measured communication: one activation hop and each stage's gradient all-reduce (ms)."""

    activation_ms: float
    allreduce_ms: list[float]


def _run_ranks(size: int, body: Callable[[Any, int], float]) -> list[float]:
    """Run `body(group, rank)` on `size` gloo ranks (threads of this process); their results."""
    store, results = dist.HashStore(), [0.0] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(dist.ProcessGroupGloo(store, rank, size, GLOO_TIMEOUT), rank)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def measure_hop_ms(
    shape: tuple[int, ...], repeats: int = 20, warmup: int = 3, dtype: torch.dtype = torch.float32
) -> float:
    """One activation of `shape` and `dtype` (the boundary dtype) sent between two gloo ranks on
    loopback, as the world group sends it: median over `repeats` round trips, halved."""

    def body(pg: Any, rank: int) -> float:
        buf, trips = torch.randn(shape).to(dtype), []
        for _ in range(warmup + repeats):
            t = time.perf_counter()
            if rank == 0:
                pg.send([buf], 1, 0).wait()
                pg.recv([buf], 1, 1).wait()
            else:
                pg.recv([buf], 0, 0).wait()
                pg.send([buf], 0, 1).wait()
            trips.append(1e3 * (time.perf_counter() - t))
        return statistics.median(trips[warmup:]) / 2

    return _run_ranks(2, body)[0]


def measure_allreduce_ms(num_elements: int, num_peers: int, repeats: int = 10, warmup: int = 2) -> float:
    """All-reduce of `num_elements` float64 (OPT's gradient sums: grad_sum.py) among `num_peers` gloo
    ranks on loopback (median, ms)."""

    def body(pg: Any, rank: int) -> float:
        flat, times = torch.randn(num_elements, dtype=torch.float64), []
        for _ in range(warmup + repeats):
            t = time.perf_counter()
            pg.allreduce([flat]).wait()
            times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times[warmup:])

    return max(_run_ranks(num_peers, body))


def measure_comm(
    shape: tuple[int, ...],
    stages: list[StageMeasurement],
    num_pipelines: int,
    num_microbatches: int,
    repeats: int,
    dtype: torch.dtype = torch.float32,
) -> CommMeasurement:
    """The hop time of an activation of `shape` (the largest boundary) and each stage's all-reduce
    (its gradients plus the D*M counts OPT adds)."""
    hop = measure_hop_ms(shape, repeats=max(repeats, 10), dtype=dtype)
    counts = num_pipelines * num_microbatches
    allreduce = [measure_allreduce_ms(st.num_params + counts, num_pipelines, repeats) for st in stages]
    return CommMeasurement(hop, allreduce)


def job_spec_from_profile(
    name: str,
    stages: list[StageMeasurement],
    comm: CommMeasurement,
    num_pipelines: int,
    num_microbatches: int,
    memory_capacity_mib: float | None,
) -> JobSpec:
    """The job spec (docs/contract.md section 1): every stage field measured; `cross_pipeline_ms` is
    the measured hop (on one machine a re-routed hop is the same loopback transfer); capacity as given."""
    return JobSpec.model_validate(
        {
            "name": name,
            "num_pipelines": num_pipelines,
            "num_stages": len(stages),
            "num_microbatches": num_microbatches,
            "stages": [
                {
                    "forward": st.forward_ms,
                    "backward_input": st.backward_input_ms,
                    "backward_weight": st.backward_weight_ms,
                    "optimizer": st.optimizer_ms,
                    "activation_mib": st.activation_mib,
                    "weight_grad_mib": st.weight_grad_mib,
                    "backward_fused_measured": st.backward_fused_ms,
                }
                for st in stages
            ],
            "comm": {
                "activation_ms": comm.activation_ms,
                "cross_pipeline_ms": comm.activation_ms,
                "allreduce_ms": comm.allreduce_ms,
            },
            "memory_capacity_mib": memory_capacity_mib,
        }
    )


def format_table(stages: list[StageMeasurement], comm: CommMeasurement) -> str:
    """Per-stage table (ms, MiB) plus the communication figures."""
    head = f"{'stage':>5} {'params':>9} {'F':>8} {'B':>8} {'W':>8} {'B+W':>8} {'BW':>8} {'OPT':>7}"
    head += f" {'AR':>7} {'act MiB':>8} {'wgrad MiB':>9}"
    rows = [head]
    for st, ar in zip(stages, comm.allreduce_ms, strict=True):
        bw = st.backward_input_ms + st.backward_weight_ms
        rows.append(
            f"{st.stage:>5} {st.num_params:>9} {st.forward_ms:>8.2f} {st.backward_input_ms:>8.2f} "
            f"{st.backward_weight_ms:>8.2f} {bw:>8.2f} {st.backward_fused_ms:>8.2f} {st.optimizer_ms:>7.2f} "
            f"{ar:>7.2f} {st.activation_mib:>8.2f} {st.weight_grad_mib:>9.2f}"
        )
    rows.append(f"activation hop {comm.activation_ms:.3f} ms (also used for cross-pipeline hops)")
    return "\n".join(rows)
