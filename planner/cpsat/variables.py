"""The variable container of the CP-SAT model: one dataclass of dicts keyed by tuples.

An op of micro-batch mb = (d_mb, m) at stage s runs on its host worker (d, s), d = host[s, d_mb, m];
its key is (d, s, mb, op) and every variable name embeds it. OPT, anchor and period variables are
keyed by worker. All times are in model units (see timing.py), one iteration in one time frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from planner.cpsat.timing import IntTiming
from planner.problem import MicroBatchId, Problem, WorkerId

OpKey = tuple[int, int, MicroBatchId, str]  # (d, s, mb, op): host worker, stage, micro-batch, F/B/W
OrderEntry = tuple[str, MicroBatchId | None]
Orders = dict[WorkerId, list[OrderEntry]]  # same shape as planner.orders.Orders
SPLIT_OPS = ("F", "B", "W")


def op_key(problem: Problem, s: int, mb: MicroBatchId, op: str) -> OpKey:
    """Key of `op` of micro-batch `mb` at stage `s`, on its host."""
    return (problem.host[s, mb[0], mb[1]], s, mb, op)


@dataclass
class CpSatVars:
    """Everything the constraint families and the extraction need to see of the model."""

    model: cp_model.CpModel
    problem: Problem
    timing: IntTiming
    horizon: int
    free_workers: set[WorkerId]  # workers whose order the solver may change
    frozen_workers: set[WorkerId]  # workers whose times are constants (their start values are ints)
    period: cp_model.IntVar
    start: dict[OpKey, cp_model.IntVar | int] = field(default_factory=dict)
    interval: dict[OpKey, cp_model.IntervalVar] = field(default_factory=dict)  # free workers only
    size: dict[OpKey, int] = field(default_factory=dict)
    ops_of: dict[WorkerId, list[OpKey]] = field(default_factory=dict)
    opt_start: dict[WorkerId, cp_model.IntVar | int] = field(default_factory=dict)
    opt_interval: dict[WorkerId, cp_model.IntervalVar] = field(default_factory=dict)
    opt_size: dict[WorkerId, int] = field(default_factory=dict)
    anchor: dict[WorkerId, cp_model.IntVar | int] = field(default_factory=dict)
    last_w_end: dict[int, cp_model.IntVar] = field(default_factory=dict)  # per stage
    # memory spans: F key -> [F.start, B.end) of that micro-batch, W key -> [B.end, W.end)
    memory_span: dict[OpKey, cp_model.IntVar] = field(default_factory=dict)

    def add(self, ct: object) -> None:
        """Add a constraint; one between constants only is checked here instead (frozen workers)."""
        if isinstance(ct, bool):
            if not ct:
                raise ValueError("frozen times break a constraint between frozen workers")
            return
        self.model.add(ct)  # type: ignore[arg-type]

    def end(self, key: OpKey) -> cp_model.LinearExprT:
        """End of an F/B/W op."""
        return self.start[key] + self.size[key]

    def opt_end(self, worker: WorkerId) -> cp_model.LinearExprT:
        """End of a worker's OPT."""
        return self.opt_start[worker] + self.opt_size[worker]


FrozenTimes = dict[WorkerId, tuple[dict[OpKey, int], int]]  # worker -> (op starts, OPT start)


def new_vars(
    problem: Problem,
    timing: IntTiming,
    horizon: int,
    free_workers: set[WorkerId],
    frozen: FrozenTimes | None = None,
) -> CpSatVars:
    """Create the model, the period and, per alive worker, its F/B/W/OPT intervals and anchor.

    Workers in `frozen` get constants instead of variables (and no intervals)."""
    frozen = frozen or {}
    model = cp_model.CpModel()
    v = CpSatVars(
        model=model,
        problem=problem,
        timing=timing,
        horizon=horizon,
        free_workers=free_workers,
        frozen_workers=set(frozen),
        period=model.new_int_var(0, horizon, "period"),
    )
    for w in problem.workers():
        d, s = w
        if w in frozen:
            starts, opt = frozen[w]
            v.ops_of[w] = sorted(starts, key=lambda k: starts[k])
            for key, t in starts.items():
                v.start[key] = t
                v.size[key] = timing.duration(key[3], w)
            v.opt_start[w] = opt
            v.opt_size[w] = timing.duration("OPT", w)
            v.anchor[w] = min(starts.values(), default=opt)
            continue
        keys: list[OpKey] = []
        for mb in problem.microbatches_on(d, s):
            for op in SPLIT_OPS:
                key = (d, s, mb, op)
                size = timing.duration(op, w)
                name = f"{op}_d{d}_s{s}_mb{mb[0]}.{mb[1]}"
                v.start[key] = model.new_int_var(0, horizon, f"start_{name}")
                v.size[key] = size
                if w in free_workers:
                    v.interval[key] = model.new_fixed_size_interval_var(v.start[key], size, f"iv_{name}")
                keys.append(key)
        v.ops_of[w] = keys
        v.opt_size[w] = timing.duration("OPT", w)
        v.opt_start[w] = model.new_int_var(0, horizon, f"start_OPT_d{d}_s{s}")
        v.opt_interval[w] = model.new_fixed_size_interval_var(
            v.opt_start[w], v.opt_size[w], f"iv_OPT_d{d}_s{s}"
        )
        v.anchor[w] = model.new_int_var(0, horizon, f"anchor_d{d}_s{s}")
    return v
