"""ZB-H1 baseline (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): split B and W.

The F/B skeleton is 1F1B's (same warm-up F count, so the same activation memory), with B in place
of the fused BW; W, which nothing downstream waits for, is deferred to fill the drain bubbles. As
in torch.distributed.pipelining's ZB1P construction (`_get_1f1b_rank_ops` with
num_1f1b_microbatches = rank), stage s delays its W by s backward steps: in the steady phase it runs
F, B, W(of the B s steps back); the s W still pending after the last B run before OPT, between
the drain's B where the skeleton allows. Stage 0 never defers; the last stage defers P-1. Failure-
free this reaches ZB-H1's iteration time M(F+B+W) + (P-1)(F+B-W) on a uniform job. Where a memory
capacity is given, a deferred W runs early rather than lift the worker over it (ZB-H1's promise
is 1F1B's memory; the deferred weight gradients are the only extra).

Under failures the hosts are the naive re-route ones and the skeleton is the index-keyed 1F1B of
`one_f_one_b` (deadlock-free for any hosting; equal to the classic order failure-free).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from planner.baselines.one_f_one_b import (
    build_problem,
    defer_weight_grads,
    hosted_microbatches,
    interleaved_order,
)
from planner.problem import Problem

if TYPE_CHECKING:
    from planner.orders import Orders

__all__ = ["Delay", "build_orders", "build_problem"]

Delay = Callable[[int, int, int, int], int]  # (stage, stages, hosted, micro-batches) -> W delay


def zb_h1_delay(stage: int, stages: int, hosted: int, microbatches: int) -> int:
    """ZB-H1's: stage s defers its W by s backward steps."""
    return stage


def build_orders(problem: Problem, delay: Delay = zb_h1_delay) -> Orders:
    """ZB-H1 orders (F, B, W, OPT) for every alive worker of `problem`; `delay(s, P, hosted, M)`
    backward steps by which stage s defers its W (default ZB-H1's s; planner/adaptive/zb_delays.py
    tries longer ones)."""
    orders: Orders = {}
    for (d, s), mbs in hosted_microbatches(problem).items():
        skeleton = interleaved_order(problem.num_stages, s, mbs, backward="B")
        prof = problem.job.stages[s]
        order = defer_weight_grads(
            skeleton,
            delay=max(0, delay(s, problem.num_stages, len(mbs), problem.num_microbatches)),
            activation_mib=prof.activation_mib,
            weight_grad_mib=prof.weight_grad_mib,
            capacity_mib=problem.job.capacity_mib(s),
        )
        orders[d, s] = [*order, ("OPT", None)]
    return orders
