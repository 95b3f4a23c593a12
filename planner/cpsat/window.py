"""Window family: each worker's iteration fits in [anchor, anchor + T].

Iteration k+1 of worker w then starts at or after anchor + (k+1)T, which is at or after its OPT of
iteration k: repeating the one-iteration solution every T is a valid periodic schedule, and
the ASAP replay of the same orders has a period of at most T.
"""

from __future__ import annotations

from planner.cpsat.variables import CpSatVars


def add_windows(v: CpSatVars, lower_bound_units: int, max_period_units: int | None = None) -> None:
    """anchor <= every F start (B, W, OPT follow an F of the same worker); OPT end <= anchor + T;
    T >= the load bound (and <= `max_period_units` when given).

    Redundant but decisive for the bound: the window holds the worker's own ops back to back, then
    the all-reduce, then its OPT, so T >= busy + allreduce + optimizer per worker.
    """
    for w, keys in v.ops_of.items():
        busy = sum(v.size[k] for k in keys)
        v.add(v.period >= busy + v.timing.allreduce(w[1]) + v.opt_size[w])
        a = v.anchor[w]
        for key in keys:
            if key[3] == "F":
                v.add(a <= v.start[key])
        v.add(a <= v.opt_start[w])
        v.add(v.opt_end(w) <= a + v.period)
    v.add(v.period >= lower_bound_units)
    if max_period_units is not None:
        v.add(v.period <= max_period_units)
