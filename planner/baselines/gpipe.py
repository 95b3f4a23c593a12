"""GPipe baseline: all forwards, then all (fused) backwards, then OPT.

Each alive worker runs the F of every micro-batch it hosts in micro-batch order (m, then d), then
their BW in the same order, then OPT. Hosts are the naive re-route ones under failures. Deadlock-free
for any hosting: every F depends only on F of the stage before (so stage by stage all F finish),
and every BW only on the stage after's BW (so from the last stage back all BW finish). Activation
memory grows with the number of hosted micro-batches, which is GPipe's known cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.baselines.one_f_one_b import build_problem, hosted_microbatches
from planner.problem import Problem

if TYPE_CHECKING:
    from planner.orders import Orders

__all__ = ["build_orders", "build_problem"]


def build_orders(problem: Problem) -> Orders:
    """GPipe orders (F..F, BW..BW, OPT) for every alive worker of `problem`."""
    orders: Orders = {}
    for w, mbs in hosted_microbatches(problem).items():
        orders[w] = [*(("F", mb) for mb in mbs), *(("BW", mb) for mb in mbs), ("OPT", None)]
    return orders
