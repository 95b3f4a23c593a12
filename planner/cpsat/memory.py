"""Memory family: one cumulative per free worker whose stage has a capacity.

A micro-batch holds activation_mib over [F.start, B.end) and weight_grad_mib over [B.end, W.end).
Demands are rounded up and the capacity down (in 1/MEMORY_SCALE MiB), so the model stays
conservative. Iterations never overlap on a worker (its next iteration waits for its OPT, after
every W), so one iteration's profile is the worker's whole profile. Fixed-order workers are skipped:
their order alone decides which ops overlap.
"""

from __future__ import annotations

import math

from planner.cpsat.variables import CpSatVars, OpKey

MEMORY_SCALE = 1000  # model memory units per MiB


def add_memory(v: CpSatVars) -> None:
    """Cumulative of activations and deferred weight gradients against job.capacity_mib(s)."""
    p = v.problem
    for w in p.workers():
        d, s = w
        cap = p.job.capacity_mib(s)
        if cap is None or w not in v.free_workers:
            continue
        prof = p.job.stages[s]
        act = math.ceil(prof.activation_mib * MEMORY_SCALE - 1e-6)
        grad = math.ceil(prof.weight_grad_mib * MEMORY_SCALE - 1e-6)
        intervals = []
        demands = []
        by_mb: dict[tuple[int, int], dict[str, OpKey]] = {}
        for key in v.ops_of[w]:
            by_mb.setdefault(key[2], {})[key[3]] = key
        for mb, ops in by_mb.items():
            f, b, wk = ops["F"], ops["B"], ops["W"]
            name = f"d{d}_s{s}_mb{mb[0]}.{mb[1]}"
            size = v.model.new_int_var(0, v.horizon, f"act_size_{name}")
            v.memory_span[f] = size
            intervals.append(v.model.new_interval_var(v.start[f], size, v.end(b), f"act_{name}"))
            demands.append(act)
            grad_size = v.size[wk]  # W.end - B.end >= W's duration; its exact span is W.end - B.end
            span = v.model.new_int_var(grad_size, v.horizon, f"grad_size_{name}")
            v.memory_span[wk] = span
            intervals.append(v.model.new_interval_var(v.end(b), span, v.end(wk), f"grad_{name}"))
            demands.append(grad)
        v.model.add_cumulative(intervals, demands, math.floor(cap * MEMORY_SCALE + 1e-6))
