"""`lns_orders`: large-neighbourhood search on the periodic model (issue 13, tight memory).

Where memory does not cover a stage's round trip (the `-mem1x` instances), CP-SAT on the whole
model rarely improves the greedy's orders within its time limit: the model is large and every
order is free. Here each step frees only a time window of one iteration: the ops whose start, in
the current orders' steady-state times (`hint_times`), lies in a window of `window_fraction` of
the period, on every worker; every other op keeps its place in its worker's order (a chain of
precedences over the ops outside the window). CP-SAT re-solves that model for `step_s` from the
current orders as a full hint, and the referee's replay of its orders (`to_schedule`) is kept
when it is shorter. Most windows are placed around an idle gap of one of the busiest workers (what
the period has above their load), the rest anywhere in the period (wrapping around it), so
successive steps move every part of the iteration, including the boundary where a stage's last
Ws meet the next iteration's Fs. docs/planner.md section 5 has the figures and what was tried.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from planner.contract import Schedule
from planner.cpsat.build import BuildOptions, build_model
from planner.cpsat.extract import extract_orders
from planner.cpsat.hint import HintTimes, add_hint, hint_times
from planner.cpsat.solve import solve
from planner.cpsat.timing import DEFAULT_SCALE, IntTiming
from planner.cpsat.variables import CpSatVars, Orders, op_key
from planner.errors import ScheduleRuleError
from planner.orders import to_schedule
from planner.problem import Problem, WorkerId

log = logging.getLogger(__name__)

EPS_MS = 1e-6
BUSY_SHARE = 0.02  # workers busy within 2% of the busiest
RANDOM_SHARE = 0.25
LARGE_OPS = 4000


@dataclass(frozen=True)
class LnsOptions:
    window_fraction: float = 0.25  # share of the period freed per step
    step_s: float = 2.0  # CP-SAT time per step
    seed: int = 0
    one_stage: bool = False  # free only the window's ops on the stage of the chosen gap
    presolve: bool = True  # CP-SAT's presolve (4-5 s on 6,000 ops: longer than a step)

    @staticmethod
    def for_size(num_ops: int) -> LnsOptions:
        """The defaults; from LARGE_OPS ops (gpt3-13b-p8d8-mem1x: 6,100) one-stage windows of 30% of
        the period, 3 s steps without presolve, the only variant that moved 13b (docs/planner.md 5)."""
        if num_ops < LARGE_OPS:
            return LnsOptions()
        return LnsOptions(window_fraction=0.3, step_s=3.0, one_stage=True, presolve=False)


@dataclass
class LnsOutcome:
    """The best orders found (the hint's when no step improved) and their replayed schedule."""

    orders: Orders
    schedule: Schedule
    steps: int
    improvements: int
    wall_s: float


def lns_orders(
    problem: Problem,
    hint: Orders,
    time_limit: datetime.timedelta,
    lower_bound_ms: float,
    progress: Callable[[float, float], None] | None = None,
    options: LnsOptions | None = None,
    target_ms: float = 0.0,
) -> LnsOutcome:
    """Improve `hint` (complete, valid orders) by window re-solves until `time_limit` is spent or
    the replay reaches `target_ms` (a lower bound: nothing below it exists).

    `progress(elapsed_s, best_ms)` is called after each improvement. Raises ScheduleRuleError
    when `hint` itself does not replay."""
    opts = options or LnsOptions.for_size(sum(len(seq) for seq in hint.values()))
    t0 = time.monotonic()
    deadline = t0 + time_limit.total_seconds()
    rng = random.Random(opts.seed)
    orders = hint
    best = to_schedule(problem, orders, strategy="recycle-cpsat")
    timing = IntTiming(problem, scale=DEFAULT_SCALE)
    steps = improvements = 0
    h = hint_times(problem, orders, timing)
    while deadline - time.monotonic() > 0.5 and best.iteration_time_ms > target_ms * (1 + 1e-9):
        width = opts.window_fraction * h.period
        a, stage = _window_start(orders, h, timing, rng, width)
        stages = {stage} if opts.one_stage else None
        v = _window_model(problem, orders, h, timing, lower_bound_ms, a, a + width, stages)
        add_hint(v, h)
        left = deadline - time.monotonic()
        limit = datetime.timedelta(seconds=min(opts.step_s, left))
        res = solve(v, limit, num_workers=2, cp_model_presolve=opts.presolve)
        steps += 1
        log.debug(
            "LNS step %d: %d free workers, %s in %.2f s",
            steps,
            len(v.free_workers),
            res.status.name,
            res.wall_s,
        )
        if not res.status.has_solution():
            continue
        new = extract_orders(v, res.solver)
        try:
            sched = to_schedule(problem, new, strategy="recycle-cpsat")
        except ScheduleRuleError as exc:  # the referee disagrees with the model: keep the current orders
            log.warning("LNS step %d: orders rejected by the simulator: %s", steps, exc)
            continue
        if sched.iteration_time_ms < best.iteration_time_ms - EPS_MS:
            best, orders, h = sched, new, hint_times(problem, new, timing)
            improvements += 1
            if progress:
                progress(time.monotonic() - t0, best.iteration_time_ms)
    log.info("LNS: %d steps, %d improvements, %.3f ms", steps, improvements, best.iteration_time_ms)
    return LnsOutcome(orders, best, steps, improvements, time.monotonic() - t0)


def _window_start(
    orders: Orders, h: HintTimes, timing: IntTiming, rng: random.Random, width: float
) -> tuple[float, int]:
    """Where the next window starts, and the stage of its gap: mostly around an idle gap of one of
    the busiest workers (busy within BUSY_SHARE of the most: their idle is what the period has above
    their load), the gaps weighted by length, so the gap lies inside the window; one step in
    RANDOM_SHARE anywhere (a random stage)."""
    busy: dict[WorkerId, float] = {}
    gaps: dict[WorkerId, list[tuple[int, int]]] = {}
    for w, seq in orders.items():
        times = [
            (h.opt_start[w] if mb is None else h.start[w[1], mb, op], timing.duration(op, w))
            for op, mb in seq
        ]
        busy[w] = sum(d for _, d in times)
        gaps[w] = [(t1 - t0 - d0, t1) for (t0, d0), (t1, _) in itertools.pairwise(times) if t1 > t0 + d0]
    top = max(busy.values())
    cands = [(g, t, w[1]) for w, gs in gaps.items() if busy[w] >= top * (1 - BUSY_SHARE) for g, t in gs]
    if not cands or rng.random() < RANDOM_SHARE:
        return rng.uniform(0.0, float(h.period)), rng.choice(sorted({w[1] for w in orders}))
    _, at, stage = rng.choices(cands, weights=[g for g, _, _ in cands])[0]
    return at - rng.uniform(0.2, 0.8) * width, stage


def _window_model(
    problem: Problem,
    orders: Orders,
    h: HintTimes,
    timing: IntTiming,
    lower_bound_ms: float,
    a: float,
    b: float,
    stages: set[int] | None = None,
) -> CpSatVars:
    """The periodic model where only the ops starting in the window [a, b) (modulo the period), on
    `stages` (None: every stage), are free. A worker with none keeps its order as a chain (no
    intervals, no memory: its order fixes both); a worker with some gets its no-overlap and memory,
    and a chain over its other ops."""
    period = h.period
    free_ops: set[tuple[WorkerId, int]] = set()
    for w, seq in orders.items():
        if stages is not None and w[1] not in stages:
            continue
        for i, (op, mb) in enumerate(seq):
            if mb is not None and (h.start[w[1], mb, op] - a) % period < b - a:
                free_ops.add((w, i))
    free_workers = frozenset(w for w, _ in free_ops)
    max_end = max([*h.opt_start.values(), *h.start.values()])
    options = BuildOptions(
        horizon_ms=(max_end + 2 * period) / timing.scale,
        lower_bound_ms=lower_bound_ms,
        scale=timing.scale,
        free_workers=free_workers,
        symmetry=False,  # the chains keep the hint's labels; symmetry breaking could contradict them
    )
    v = build_model(problem, options, fixed_orders=orders)
    for w in free_workers:
        prev_end = None
        for i, (op, mb) in enumerate(orders[w]):
            if mb is None or (w, i) in free_ops:
                continue
            key = op_key(problem, w[1], mb, op)
            if prev_end is not None:
                v.add(v.start[key] >= prev_end)
            prev_end = v.end(key)
    return v
