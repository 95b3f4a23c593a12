"""Extraction: the only place reading the solver's values. Turns a solution into Orders and a period."""

from __future__ import annotations

from ortools.sat.python import cp_model

from planner.cpsat.variables import CpSatVars, OrderEntry, Orders

_OP_RANK = {"F": 0, "B": 1, "W": 2}


def _value(solver: cp_model.CpSolver, x: cp_model.IntVar | int) -> int:
    return x if isinstance(x, int) else int(solver.value(x))


def extract_orders(v: CpSatVars, solver: cp_model.CpSolver) -> Orders:
    """Per alive worker, its F/B/W sorted by model start time, then ("OPT", None)."""
    orders: Orders = {}
    for w, keys in v.ops_of.items():
        timed = sorted((_value(solver, v.start[k]), _OP_RANK[k[3]], k[2], k[3]) for k in keys)
        entries: list[OrderEntry] = [(op, mb) for _, _, mb, op in timed]
        entries.append(("OPT", None))
        orders[w] = entries
    return orders


def extract_period_ms(v: CpSatVars, solver: cp_model.CpSolver) -> float:
    """The model's period T in ms."""
    return v.timing.to_ms(solver.value(v.period))


def extract_starts_ms(v: CpSatVars, solver: cp_model.CpSolver) -> dict[tuple, float]:
    """Start time (ms) of every op key, and of each worker's OPT keyed (d, s, None, "OPT")."""
    out: dict[tuple, float] = {k: v.timing.to_ms(_value(solver, x)) for k, x in v.start.items()}
    for (d, s), x in v.opt_start.items():
        out[d, s, None, "OPT"] = v.timing.to_ms(_value(solver, x))
    return out
