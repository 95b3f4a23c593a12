"""`improve_orders`: take good orders as a hint, let CP-SAT shorten the period, report a bound."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from planner.cpsat.build import BuildOptions, build_model
from planner.cpsat.extract import extract_orders, extract_period_ms
from planner.cpsat.hint import add_hint, frozen_times, hint_times
from planner.cpsat.solve import Progress, SolveStatus, solve
from planner.cpsat.symmetry import canonical_orders
from planner.cpsat.timing import DEFAULT_SCALE, IntTiming
from planner.cpsat.variables import Orders
from planner.errors import InvalidInputError
from planner.problem import Problem

log = logging.getLogger(__name__)


@dataclass
class CpSatOutcome:
    """What the CP-SAT layer found.

    `orders` (None without a solution) list each alive worker's ops by model start time, ending
    with ("OPT", None). `period_ms` is the model's T: the replayed iteration time of these orders is
    at most T in steady state. `bound_ms` is a proven lower bound on the period, >= the load bound
    given (only the load bound when the model rounded times, or re-optimised only some stages).
    """

    status: SolveStatus
    orders: Orders | None
    period_ms: float | None
    bound_ms: float
    wall_s: float
    hint_period_ms: float | None = None  # the hint's T in the same model (what CP-SAT started from)


def improve_orders(
    problem: Problem,
    hint: Orders,
    time_limit: datetime.timedelta,
    lower_bound_ms: float,
    progress: Progress | None = None,
    num_workers: int = 2,
    stages: Iterable[int] | None = None,
    scale: int = DEFAULT_SCALE,
    keep: str = "times",
) -> CpSatOutcome:
    """Improve `hint` (a complete, valid set of orders) within `time_limit`.

    `stages` None re-optimises every worker; otherwise only the workers of those stages, the other
    workers keep their hint times as constants (`keep="times"`, small model: the way to run
    gpt3-175b) or their hint orders as precedence chains (`keep="orders"`, more freedom, but every
    op stays a variable). See `decompose.stages_to_reoptimise`.
    Raises ScheduleRuleError when the hint deadlocks, InvalidInputError when it misses a worker.
    """
    t0 = time.monotonic()
    missing = [list(w) for w in problem.workers() if w not in hint]
    if missing:
        raise InvalidInputError(f"hint has no order for alive worker(s) {missing}")
    free_stages = BuildOptions.stages(stages)
    whole = free_stages is None or free_stages >= set(range(problem.num_stages))
    orders = canonical_orders(problem, hint) if whole else hint
    h = hint_times(problem, orders, IntTiming(problem, scale=scale))
    max_end = max([*h.opt_start.values(), *h.start.values()])
    options = BuildOptions(
        horizon_ms=(max_end + 2 * h.period) / scale,
        lower_bound_ms=lower_bound_ms,
        scale=scale,
        free_stages=None if whole else free_stages,
        symmetry=whole,
    )
    frozen = None
    if free_stages is not None and not whole and keep == "times":
        frozen = frozen_times(problem, h, [w for w in problem.workers() if w[1] not in free_stages])
    elif keep not in ("times", "orders"):
        raise InvalidInputError(f"keep: expected 'times' or 'orders', got {keep!r}")
    v = build_model(problem, options, fixed_orders=orders, frozen=frozen)
    add_hint(v, h)
    build_s = time.monotonic() - t0
    remaining = time_limit - datetime.timedelta(seconds=build_s)
    log.info(
        "cp-sat model: %d ops, %d free workers, hint T %.3f ms, built in %.2fs",
        len(v.start),
        len(v.free_workers),
        h.period / scale,
        build_s,
    )
    res = solve(v, remaining, num_workers=num_workers, progress=progress)
    bound_ms = lower_bound_ms
    if whole and v.timing.exact and res.status is not SolveStatus.INFEASIBLE:
        bound_ms = max(bound_ms, res.bound / scale)
    out_orders = extract_orders(v, res.solver) if res.status.has_solution() else None
    period = extract_period_ms(v, res.solver) if res.status.has_solution() else None
    return CpSatOutcome(
        status=res.status,
        orders=out_orders,
        period_ms=period,
        bound_ms=bound_ms,
        wall_s=time.monotonic() - t0,
        hint_period_ms=h.period / scale,
    )
