"""A simple valid hint for tests and experiments: GPipe-like orders.

Every worker runs all its F in (m, d) order, then all its B in the same order, each followed by its
W, then OPT. Orders that agree with one global micro-batch order never deadlock. Memory is not
considered (every activation is live at once), so it only fits jobs with room.
"""

from __future__ import annotations

from planner.cpsat.variables import OrderEntry, Orders
from planner.problem import Problem


def gpipe_orders(problem: Problem) -> Orders:
    """GPipe-like orders for every alive worker of `problem`."""
    orders: Orders = {}
    for d, s in problem.workers():
        mbs = problem.microbatches_on(d, s)
        entries: list[OrderEntry] = [("F", mb) for mb in mbs]
        for mb in mbs:
            entries += [("B", mb), ("W", mb)]
        entries.append(("OPT", None))
        orders[d, s] = entries
    return orders
