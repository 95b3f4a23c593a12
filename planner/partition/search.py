"""Which contiguous layer split minimizes the load bound under a failure set (exactly, by DP).

Under a failure set the alive peers of stage s share its D*M micro-batches; how planner.bounds
allocates them depends only on who is alive and slow, not on the stage's work. So the load bound of
stage s holding layers [a, b) is max over its peers d of c_d*f_d*work(a, b) + allreduce(a, b) +
optimizer(a, b)*f_d (planner/partition/derive.py gives the figures), and the bound of a partition
is the largest over its stages. A DP over the split points finds the least such bound over all
partitions (each stage >= 0 layers: a stage may hand all its layers to its neighbours and run only
its extras; each holding at least one micro-batch's activations within its memory capacity); a
second DP finds, under a bound threshold, the partition that moves the fewest
layers from the job's own.
"""

from __future__ import annotations

import math

import numpy as np

from planner.bounds import allocate_stage
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError
from planner.partition.layers import LayerModel

INF = math.inf


def _prefix(values: list[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(values)])


def _ratios(model: LayerModel, s: int, a_idx: np.ndarray, b_idx: np.ndarray) -> np.ndarray:
    """derive._ratio for every [a, b) at once."""
    a0, b0 = model.partition[s]
    params = _prefix([x.param_mib for x in model.layers])
    if params[b0] - params[a0] > 0:
        return (params[b_idx] - params[a_idx]) / (params[b0] - params[a0])
    if b0 > a0:
        return (b_idx - a_idx) / (b0 - a0)
    return np.ones(a_idx.shape)  # empty in the job's partition: stage_costs keeps it so, its own figures


def stage_costs(job: JobSpec, model: LayerModel, scenario: FailureScenario) -> list[np.ndarray]:
    """Per stage s, the L+1 x L+1 matrix of its load bound holding layers [a, b) (inf where a > b or
    the layers leave no room for one micro-batch's activations; a == b is the empty stage, which
    runs only its extras)."""
    n = model.num_layers
    work = _prefix([x.forward + x.backward_input + x.backward_weight for x in model.layers])
    act = _prefix([x.activation_mib for x in model.layers])
    a_idx, b_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = b_idx >= a_idx
    out = []
    for s in range(job.num_stages):
        ex = model.extras[s]
        a0, b0 = model.partition[s]
        w = ex["forward"] + ex["backward_input"] + ex["backward_weight"] + work[b_idx] - work[a_idx]
        ratio = _ratios(model, s, a_idx, b_idx)
        ar, opt = job.allreduce_ms(s) * ratio, job.stages[s].optimizer * ratio
        alloc = allocate_stage(job, scenario, s)
        pairs = {
            (c * scenario.slow_factor((d, s)), scenario.slow_factor((d, s))) for d, c in alloc.counts.items()
        }
        cost = np.max([cf * w + ar + opt * f for cf, f in pairs], axis=0)
        ok = valid & (b_idx == a_idx) if b0 == a0 else valid.copy()  # no per-layer scale: stays empty
        if job.capacity_mib(s) is not None:
            res = _prefix([x.param_mib + x.optimizer_state_mib for x in model.layers])
            cap = job.capacity_mib(s) + (res[b0] - res[a0]) - (res[b_idx] - res[a_idx])  # type: ignore[operator]
            ok &= cap >= ex["activation_mib"] + act[b_idx] - act[a_idx] - 1e-9
        out.append(np.where(ok, cost, INF))
    return out


def _backtrack(choice: list[np.ndarray], n: int) -> list[list[int]]:
    ranges, b = [], n
    for s in range(len(choice) - 1, -1, -1):
        a = int(choice[s][b])
        ranges.append([a, b])
        b = a
    return ranges[::-1]


def best_partition(costs: list[np.ndarray]) -> tuple[float, list[list[int]] | None]:
    """The least load bound over all partitions, and one partition reaching it (None: none fits)."""
    n = costs[0].shape[0] - 1
    best = costs[0][0].copy()  # best[b]: stages 0..s on layers [0, b)
    choice = [np.zeros(n + 1, dtype=int)]
    for c in costs[1:]:
        cand = np.maximum(best[:, None], c)  # [a, b]
        choice.append(np.argmin(cand, axis=0))
        best = np.min(cand, axis=0)
    value = float(best[n])
    return (value, _backtrack(choice, n)) if math.isfinite(value) else (INF, None)


def fewest_moves(costs: list[np.ndarray], model: LayerModel, threshold: float) -> list[list[int]] | None:
    """Among partitions whose load bound is <= threshold, one moving the fewest layers."""
    n = costs[0].shape[0] - 1
    a_idx, b_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    moved = []
    for a0, b0 in model.partition:
        overlap = np.clip(np.minimum(b_idx, b0) - np.maximum(a_idx, a0), 0, None)
        moved.append((b_idx - a_idx) - overlap)
    best = np.where(costs[0][0] <= threshold, moved[0][0], INF)
    choice = [np.zeros(n + 1, dtype=int)]
    for c, m in zip(costs[1:], moved[1:], strict=True):
        cand = np.where(c <= threshold, best[:, None] + m, INF)
        choice.append(np.argmin(cand, axis=0))
        best = np.min(cand, axis=0)
    return _backtrack(choice, n) if math.isfinite(best[n]) else None


def partition_bound(costs: list[np.ndarray], partition: list[list[int]]) -> float:
    """The load bound of `partition` (inf when some stage cannot hold its layers)."""
    return max(float(c[a, b]) for c, (a, b) in zip(costs, partition, strict=True))


def unmeetable_stage(costs: list[np.ndarray], job: JobSpec) -> InvalidInputError:
    """The one-line error when no partition fits every stage's memory, naming a stage that cannot
    hold even one layer (each may hold none, so that is not by itself the reason)."""
    n = costs[0].shape[0] - 1
    a_idx, b_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    own = job.partition_ranges()
    for s, c in enumerate(costs):
        if own is not None and own[s][0] == own[s][1]:
            continue  # empty in the job's partition: it takes no layer under any partition
        if not np.isfinite(c[b_idx > a_idx]).any():
            cap = job.capacity_mib(s)
            return InvalidInputError(
                f"memory_capacity_mib: stage {s} ({cap} MiB) cannot hold even one layer's parameters, "
                "optimizer state and one micro-batch's activations under any partition"
            )
    return InvalidInputError(
        "memory_capacity_mib: no partition fits every stage's memory (each stage needs its layers' "
        "parameters, optimizer state and one micro-batch's activations)"
    )
