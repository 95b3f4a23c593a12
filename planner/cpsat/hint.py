"""Hint: a consistent periodic assignment of the model's variables from given orders.

We replay the orders ASAP for a few iterations in model units (our own small replay, not the
simulator's: the simulator is the referee and shares no code with the model), and take the last
iteration's times: they satisfy every precedence and keep each worker's order; each worker's
window (first op start to OPT end) is at most the steady-state period, so T = the largest window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from planner.cpsat.timing import IntTiming
from planner.cpsat.variables import CpSatVars, FrozenTimes, Orders
from planner.errors import ScheduleRuleError
from planner.problem import MicroBatchId, Problem, WorkerId

TimeKey = tuple[int, MicroBatchId, str]  # (s, mb, op); OPT is (s, (d, -1), "OPT")


@dataclass
class HintTimes:
    """Start times (model units) of one steady-state iteration, shifted to start at 0."""

    start: dict[TimeKey, int]
    opt_start: dict[WorkerId, int]
    period: int  # largest window = the hint's T
    replay_period: int  # last-iteration OPT-end step of the replay, an estimate of the iteration time


def _replay_iteration(
    problem: Problem, orders: Orders, timing: IntTiming, free_at: dict[WorkerId, int]
) -> tuple[dict[TimeKey, int], dict[WorkerId, int]]:
    """ASAP times of one iteration; `free_at` is when each worker's previous OPT ended."""
    p = problem
    end: dict[TimeKey, int] = {}
    start: dict[TimeKey, int] = {}
    opt_start: dict[WorkerId, int] = {}
    pos = dict.fromkeys(orders, 0)
    clock = dict(free_at)
    w_left = {s: p.num_pipelines * p.num_microbatches for s in range(p.num_stages)}
    last_w = dict.fromkeys(range(p.num_stages), 0)
    queue = deque(orders)
    queued = set(orders)

    def ready(w: WorkerId, op: str, mb: MicroBatchId | None) -> int | None:
        s = w[1]
        if op == "OPT":
            return last_w[s] + timing.allreduce(s) if w_left[s] == 0 else None
        assert mb is not None
        if op == "F":
            if s == 0:
                return 0
            prev = end.get((s - 1, mb, "F"))
            return None if prev is None else prev + timing.hop(p.host[s - 1, mb[0], mb[1]], w[0])
        if op == "B":
            if s == p.num_stages - 1:
                return end.get((s, mb, "F"))
            nxt = end.get((s + 1, mb, "B"))
            return None if nxt is None else nxt + timing.hop(p.host[s + 1, mb[0], mb[1]], w[0])
        return end.get((s, mb, "B"))

    while queue:
        w = queue.popleft()
        queued.discard(w)
        order = orders[w]
        while pos[w] < len(order):
            op, mb = order[pos[w]]
            t = ready(w, op, mb)
            if t is None:
                break
            t0 = max(t, clock[w])
            clock[w] = t0 + timing.duration(op, w)
            pos[w] += 1
            s = w[1]
            if op == "OPT":
                opt_start[w] = t0
                continue
            assert mb is not None
            start[s, mb, op], end[s, mb, op] = t0, clock[w]
            wake: list[WorkerId] = []
            if op == "F" and s + 1 < p.num_stages:
                wake.append((p.host[s + 1, mb[0], mb[1]], s + 1))
            elif op == "B" and s > 0:
                wake.append((p.host[s - 1, mb[0], mb[1]], s - 1))
            elif op == "W":
                w_left[s] -= 1
                last_w[s] = max(last_w[s], clock[w])
                if w_left[s] == 0:
                    wake.extend((d, s) for d in p.alive[s])
            for x in wake:
                if x not in queued and x != w:
                    queued.add(x)
                    queue.append(x)
    stuck = [w for w, i in pos.items() if i < len(orders[w])]
    if stuck:
        w = stuck[0]
        raise ScheduleRuleError(
            "deadlock", f"hint orders deadlock: worker {list(w)} waits at {orders[w][pos[w]]}"
        )
    return start, opt_start


def hint_times(problem: Problem, orders: Orders, timing: IntTiming, num_iterations: int = 6) -> HintTimes:
    """Replay `orders` ASAP for `num_iterations` and return the last iteration's consistent times."""
    free_at = dict.fromkeys(orders, 0)
    start: dict[TimeKey, int] = {}
    opt_start: dict[WorkerId, int] = {}
    prev_last_opt = 0
    last_opt = 0
    for _ in range(num_iterations):
        start, opt_start = _replay_iteration(problem, orders, timing, free_at)
        free_at = {w: t + timing.duration("OPT", w) for w, t in opt_start.items()}
        prev_last_opt, last_opt = last_opt, max(free_at.values())
    origin = min([*start.values(), *opt_start.values()])
    start = {k: t - origin for k, t in start.items()}
    opt_start = {w: t - origin for w, t in opt_start.items()}
    period = 0
    for w, order in orders.items():
        first_op, first_mb = order[0]
        first = opt_start[w] if first_mb is None else start[w[1], first_mb, first_op]
        period = max(period, opt_start[w] + timing.duration("OPT", w) - first)
    return HintTimes(start=start, opt_start=opt_start, period=period, replay_period=last_opt - prev_last_opt)


def frozen_times(problem: Problem, h: HintTimes, workers: list[WorkerId]) -> FrozenTimes:
    """The hint's times of `workers`, in the form `new_vars` freezes them."""
    out: FrozenTimes = {}
    for d, s in workers:
        starts = {(d, s, mb, op): h.start[s, mb, op] for mb in problem.microbatches_on(d, s) for op in "FBW"}
        out[d, s] = (starts, h.opt_start[d, s])
    return out


def add_hint(v: CpSatVars, h: HintTimes) -> None:
    """AddHint every variable of the model from `h` (a complete, feasible assignment)."""
    m = v.model
    end: dict[tuple[int, MicroBatchId, str], int] = {}
    for key, var in v.start.items():
        _, s, mb, op = key
        t = h.start[s, mb, op]
        if not isinstance(var, int):
            m.add_hint(var, t)
        end[s, mb, op] = t + v.size[key]
    for w, var in v.opt_start.items():
        anchor = v.anchor[w]
        if isinstance(var, int) or isinstance(anchor, int):
            continue
        m.add_hint(var, h.opt_start[w])
        first = min([h.start[w[1], k[2], k[3]] for k in v.ops_of[w]], default=h.opt_start[w])
        m.add_hint(anchor, first)
    for s, var in v.last_w_end.items():
        m.add_hint(var, max(t for (ss, _, op), t in end.items() if ss == s and op == "W"))
    for key, var in v.memory_span.items():
        _, s, mb, op = key
        if op == "F":
            m.add_hint(var, end[s, mb, "B"] - h.start[s, mb, "F"])
        else:
            m.add_hint(var, end[s, mb, "W"] - end[s, mb, "B"])
    m.add_hint(v.period, h.period)
