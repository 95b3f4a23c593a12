"""Solver wrapper: run CP-SAT on a built model and map every CP-SAT status to `SolveStatus`.

A time-out is a status (FEASIBLE or NO_SOLUTION), never an exception. Progress is reported
through a solution callback, throttled to one call per `PROGRESS_EVERY_S`.
"""

from __future__ import annotations

import datetime
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from planner.cpsat.variables import CpSatVars

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5
FAST_PARAMS: dict[str, object] = {
    "linearization_level": 0,
    "use_precedences_in_disjunctive_constraint": False,
    "transitive_precedences_work_limit": 0,
    "use_dual_scheduling_heuristics": False,
}
Progress = Callable[[float, float, float], None]  # (elapsed_s, best_period_ms, bound_ms)


class SolveStatus(enum.Enum):
    """Outcome of a solve, in the project's words."""

    OPTIMAL = "optimal"  # proven best period for the model
    FEASIBLE = "feasible"  # a solution, not proven optimal (time limit)
    NO_SOLUTION = "no_solution"  # time limit reached without any solution
    INFEASIBLE = "infeasible"  # proven: no schedule fits the model's constraints
    MODEL_INVALID = "model_invalid"  # a bug in model building

    def has_solution(self) -> bool:
        """True when the solver holds a solution to extract."""
        return self in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)


_STATUS = {
    cp_model.OPTIMAL: SolveStatus.OPTIMAL,
    cp_model.FEASIBLE: SolveStatus.FEASIBLE,
    cp_model.UNKNOWN: SolveStatus.NO_SOLUTION,
    cp_model.INFEASIBLE: SolveStatus.INFEASIBLE,
    cp_model.MODEL_INVALID: SolveStatus.MODEL_INVALID,
}


@dataclass
class SolveResult:
    """Status, the solver (holding the solution when there is one), and bounds in model units."""

    status: SolveStatus
    solver: cp_model.CpSolver
    objective: float | None
    bound: float
    wall_s: float


class _ProgressCallback(cp_model.CpSolverSolutionCallback):
    def __init__(self, progress: Progress, scale: int) -> None:
        super().__init__()
        self._progress = progress
        self._scale = scale
        self._last = -PROGRESS_EVERY_S

    def on_solution_callback(self) -> None:
        now = self.wall_time
        if now - self._last >= PROGRESS_EVERY_S:
            self._last = now
            self._progress(now, self.objective_value / self._scale, self.best_objective_bound / self._scale)


def _solve_interruptibly(
    solver: cp_model.CpSolver, model: cp_model.CpModel, cb: cp_model.CpSolverSolutionCallback | None
) -> Any:
    """`solver.solve(model, cb)`; on the main thread in a helper thread, so that the main thread can
    take a KeyboardInterrupt (Ctrl+C) at once: the search is stopped and the interrupt raised."""
    if threading.current_thread() is not threading.main_thread():
        return solver.solve(model, cb)
    out: dict[str, object] = {}
    done = threading.Event()  # not Thread.join: one a KeyboardInterrupt cut short can mark a running
    # thread as ended (CPython's _wait_for_tstate_lock releases the thread's own lock), and the
    # process then exits during the search ("terminate called without an active exception")

    def run() -> None:
        try:
            out["code"] = solver.solve(model, cb)
        except BaseException as e:  # the callback's error: raised on the main thread below
            out["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="cp-sat", daemon=True).start()
    try:
        while not done.wait(0.1):
            pass
    except BaseException:
        solver.stop_search()
        done.wait()
        raise
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["code"]  # type: ignore[return-value]


def solve(
    v: CpSatVars,
    time_limit: datetime.timedelta,
    num_workers: int = 2,
    progress: Progress | None = None,
    **params: object,
) -> SolveResult:
    """Minimise the period under `time_limit` with `num_workers` threads; extra CP-SAT `params` by name."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_limit.total_seconds(), 0.01)
    solver.parameters.num_workers = num_workers
    # Measured on gpt3-6.7b-p8d4 (1.5k ops): with CP-SAT's defaults the root propagation (disjunctive
    # precedences, transitive precedences, the LP relaxation) runs tens of seconds past the time
    # limit before the first branch. Without them the hint loads in < 1 s and LNS improves it.
    for name, value in FAST_PARAMS.items():
        setattr(solver.parameters, name, value)
    for name, value in params.items():
        setattr(solver.parameters, name, value)
    # Ctrl+C stays Python's: CP-SAT's own SIGINT handler ends the search quietly and leaves SIGINT at
    # the default action afterwards, so the next Ctrl+C killed the process without a word.
    solver.parameters.catch_sigint_signal = False
    t0 = time.monotonic()
    cb = _ProgressCallback(progress, v.timing.scale) if progress is not None else None
    code = _solve_interruptibly(solver, v.model, cb)
    wall = time.monotonic() - t0
    status = _STATUS.get(code, SolveStatus.MODEL_INVALID)
    objective = solver.objective_value if status.has_solution() else None
    bound = solver.best_objective_bound if status is not SolveStatus.INFEASIBLE else float("inf")
    log.info(
        "cp-sat %s in %.2fs: period %s, bound %.0f (units of 1/%d ms)",
        status.name,
        wall,
        objective,
        bound,
        v.timing.scale,
    )
    return SolveResult(status=status, solver=solver, objective=objective, bound=bound, wall_s=wall)
