"""CP-SAT refinement of a greedy schedule: solve, then let the simulator judge the result."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from planner.contract import Schedule
from planner.cpsat import SolveStatus, improve_orders
from planner.cpsat.lns import lns_orders
from planner.errors import ScheduleRuleError
from planner.orders import Orders, to_schedule
from planner.problem import Problem

log = logging.getLogger(__name__)


def refine_with_cpsat(
    problem: Problem,
    hint: Orders,
    time_limit: timedelta,
    lower_bound_ms: float,
    memory_bound_ms: float,
    progress: Callable[[str], None] | None = None,
    windows: bool = False,
) -> tuple[Schedule | None, dict[str, object]]:
    """Improve `hint` with the CP-SAT model under `time_limit`: the whole model, or with `windows`
    its large-neighbourhood search (planner/cpsat/lns.py; where memory does not cover a round trip).

    Returns the replayed schedule of the model's orders (None when it found none or the
    simulator rejects them) and a summary: status, model period, proven bound, wall time.
    """
    if progress:
        how = "window re-solves" if windows else "the whole model"
        progress(f"cp-sat: refining the greedy plan for up to {time_limit.total_seconds():g} s ({how})")
    if windows:
        return _refine_windows(problem, hint, time_limit, lower_bound_ms, memory_bound_ms, progress)

    def on_progress(elapsed: float, period: float, bound: float) -> None:
        if progress:
            progress(
                f"cp-sat {elapsed:.1f} s in: best iteration period {period:.3f} ms, "
                f"proven lower bound {bound:.3f} ms"
            )

    outcome = improve_orders(
        problem, hint, time_limit=time_limit, lower_bound_ms=lower_bound_ms, progress=on_progress
    )
    info: dict[str, object] = {
        "status": outcome.status.name,
        "period_ms": outcome.period_ms,
        "bound_ms": max(outcome.bound_ms, memory_bound_ms) if outcome.bound_ms else memory_bound_ms,
        "cpsat_bound_ms": outcome.bound_ms,
        "wall_s": outcome.wall_s,
    }
    if outcome.orders is None or outcome.status not in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
        return None, info
    try:
        sched = to_schedule(problem, outcome.orders, strategy="recycle-cpsat")
    except ScheduleRuleError as exc:  # the referee disagrees with the model: keep the greedy plan
        log.warning("CP-SAT orders rejected by the simulator: %s", exc)
        info["rejected"] = str(exc)
        return None, info
    info["replayed_ms"] = sched.iteration_time_ms
    return sched, info


def _refine_windows(
    problem: Problem,
    hint: Orders,
    time_limit: timedelta,
    lower_bound_ms: float,
    memory_bound_ms: float,
    progress: Callable[[str], None] | None,
) -> tuple[Schedule | None, dict[str, object]]:
    def on_progress(elapsed: float, period: float) -> None:
        if progress:
            progress(f"cp-sat windows {elapsed:.1f} s in: best iteration period {period:.3f} ms")

    out = lns_orders(
        problem, hint, time_limit, lower_bound_ms, progress=on_progress, target_ms=memory_bound_ms
    )
    info: dict[str, object] = {
        "status": "FEASIBLE",
        "method": "windows",
        "steps": out.steps,
        "improvements": out.improvements,
        "period_ms": out.schedule.iteration_time_ms,
        "bound_ms": memory_bound_ms,
        "wall_s": out.wall_s,
        "replayed_ms": out.schedule.iteration_time_ms,
    }
    return (out.schedule if out.improvements else None), info
