"""Symmetry family: interchangeable micro-batches.

Two micro-batches with the same host at every stage (the same route) see the same durations and
delays everywhere, so swapping their labels throughout maps schedules to schedules. The only
ordering this licenses without loss is one per group at a single place: we order the group's F at
stage 0 (where they share a worker) by (m, d). Ordering them on every worker (FIFO) would be a
restriction, not a relabelling, because overtaking can pay off; it is not added.

The relabelling also maps a hint onto one that satisfies the ordering (`canonical_orders`).
"""

from __future__ import annotations

import itertools

from planner.cpsat.variables import CpSatVars, Orders, op_key
from planner.problem import MicroBatchId, Problem


def route_groups(problem: Problem) -> list[list[MicroBatchId]]:
    """Micro-batches grouped by route (host per stage), each group sorted by (m, d), singletons dropped."""
    groups: dict[tuple[int, ...], list[MicroBatchId]] = {}
    for d in range(problem.num_pipelines):
        for m in range(problem.num_microbatches):
            route = tuple(problem.host[s, d, m] for s in range(problem.num_stages))
            groups.setdefault(route, []).append((d, m))
    out = [sorted(g, key=lambda mb: (mb[1], mb[0])) for g in groups.values() if len(g) > 1]
    return out


def add_symmetry_breaking(v: CpSatVars) -> None:
    """F at stage 0 of each route group in (m, d) order. Only sound when every worker is free."""
    p = v.problem
    if len(v.free_workers) != len(p.workers()):
        return
    for group in route_groups(p):
        for a, b in itertools.pairwise(group):
            v.add(v.start[op_key(p, 0, b, "F")] >= v.end(op_key(p, 0, a, "F")))


def canonical_orders(problem: Problem, orders: Orders) -> Orders:
    """Relabel micro-batches within each route group so stage 0 runs their F in (m, d) order.

    The result is the same schedule up to names, so it satisfies `add_symmetry_breaking`.
    """
    rename: dict[MicroBatchId, MicroBatchId] = {}
    for group in route_groups(problem):
        worker = (problem.host[0, group[0][0], group[0][1]], 0)
        members = set(group)
        seen = [mb for op, mb in orders[worker] if op == "F" and mb in members]
        rename.update({old: new for old, new in zip(seen, group, strict=True)})
    return {
        w: [(op, rename.get(mb, mb) if mb is not None else None) for op, mb in entries]
        for w, entries in orders.items()
    }
