"""Worker family: a worker runs one op at a time.

A free worker gets one no-overlap over its F/B/W/OPT intervals (the solver picks its order). A
worker outside the re-optimised part keeps the order it was given, as a chain of precedences.
"""

from __future__ import annotations

from planner.cpsat.variables import CpSatVars, Orders, op_key


def add_no_overlap(v: CpSatVars, fixed_orders: Orders | None) -> None:
    """No-overlap per free worker; fixed order chains (from `fixed_orders`) for the other workers."""
    p = v.problem
    for w in p.workers():
        if w in v.frozen_workers:
            continue
        if w in v.free_workers:
            ivs = [v.interval[k] for k in v.ops_of[w]]
            v.model.add_no_overlap([*ivs, v.opt_interval[w]])
            continue
        if fixed_orders is None or w not in fixed_orders:
            raise ValueError(f"worker {list(w)} is not free and has no fixed order")
        prev_end = None
        for op, mb in fixed_orders[w]:
            if op == "OPT":
                start = v.opt_start[w]
                end = v.opt_end(w)
            else:
                assert mb is not None
                key = op_key(p, w[1], mb, op)
                start, end = v.start[key], v.end(key)
            if prev_end is not None:
                v.add(start >= prev_end)
            prev_end = end
