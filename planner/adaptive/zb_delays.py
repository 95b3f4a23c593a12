"""ZB-H1 orders with other W delays: cheap extra candidates for the planner's pool.

ZB-H1 (planner/baselines/zero_bubble.py) defers stage s's W by s backward steps. With as many
micro-batches as stages (llama3-405b-p16d128: 16 for 16) the pipeline never reaches a steady phase
and deferring longer can pay: on that grid a delay of 2s (capped at P-1), and one more on workers
that host re-routed micro-batches, is 0.6-2.2% faster than ZB-H1 with one failure at a middle or the
last stage, and equal failure-free. Each variant costs one replay, so the planner just tries them.
"""

from __future__ import annotations

from planner.baselines.one_f_one_b import defer_weight_grads
from planner.baselines.zero_bubble import Delay, build_orders
from planner.orders import Orders
from planner.problem import Problem

DELAYS: dict[str, Delay] = {
    "zb-2s": lambda s, p, n, m: min(p - 1, 2 * s),
    "zb-2s+": lambda s, p, n, m: min(n - 1, 2 * s + (n > m)),
}


def zb_delay_orders(problem: Problem, delay: Delay) -> Orders:
    """ZB-H1's F/B skeleton with stage s's W deferred by `delay(s, P, hosted, M)` backward steps."""
    return build_orders(problem, delay)


def redeferred_orders(problem: Problem, orders: Orders) -> dict[str, Orders]:
    """Another generator's F/B skeleton (the greedy's: eager F, B first) with its Ws re-placed by
    ZB's rule: stage s's W runs `delay` backward steps after its B, the rest before OPT.

    On llama3-405b-p16d128 the greedy's own W placement fills idle time with Ws that then delay a
    B arriving mid-W; a fixed delay of s steps leaves stage 0 alternating B and W (it has no slack
    at the end of its iteration) and later stages, whose next F arrives about 2 s hops after stage
    0's OPT, room to defer (docs/benchmarks.md, llama3). Only Ws move, after their own B: no new
    dependency, so the orders stay deadlock-free; with a capacity a pending W runs early rather than
    lift a worker over it. Workers with a fused BW keep their order.
    """
    out: dict[str, Orders] = {}
    for name, delay in (("s", lambda s: s), ("2s", lambda s: min(problem.num_stages - 1, 2 * s))):
        new: Orders = {}
        for (d, s), order in orders.items():
            if any(op == "BW" for op, _ in order):
                new[d, s] = order
                continue
            prof = problem.job.stages[s]
            skeleton = [(op, mb) for op, mb in order if op in ("F", "B")]
            placed = defer_weight_grads(
                skeleton, delay(s), prof.activation_mib, prof.weight_grad_mib, problem.job.capacity_mib(s)
            )
            new[d, s] = [*placed, ("OPT", None)]
        if new != orders and all(o != new for o in out.values()):
            out["redefer-" + name] = new
    return out
