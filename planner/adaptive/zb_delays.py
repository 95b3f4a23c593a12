"""ZB-H1 orders with other W delays: cheap extra candidates for the planner's pool.

ZB-H1 (planner/baselines/zero_bubble.py) defers stage s's W by s backward steps. With as many
micro-batches as stages (llama3-405b-p16d128: 16 for 16) the pipeline never reaches a steady phase
and deferring longer can pay: on that grid a delay of 2s (capped at P-1), and one more on workers
that host re-routed micro-batches, is 0.6-2.2% faster than ZB-H1 with one failure at a middle or the
last stage, and equal failure-free. Each variant costs one replay, so the planner just tries them.
"""

from __future__ import annotations

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
