"""Model building: a pure function from a Problem (+ options) to the variable container.

It only composes the constraint families, in a fixed order: variables, precedences, OPT,
worker no-overlap (or fixed chains), windows and period, memory, symmetry breaking, objective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from planner.cpsat.memory import add_memory
from planner.cpsat.no_overlap import add_no_overlap
from planner.cpsat.optimizer import add_optimizer_steps
from planner.cpsat.precedence import add_precedences
from planner.cpsat.symmetry import add_symmetry_breaking
from planner.cpsat.timing import DEFAULT_SCALE, IntTiming
from planner.cpsat.variables import CpSatVars, FrozenTimes, Orders, new_vars
from planner.cpsat.window import add_windows
from planner.problem import Problem, WorkerId


@dataclass(frozen=True)
class BuildOptions:
    """What to build.

    `horizon_ms` bounds every time of the iteration frame. `free_stages` None re-optimises every
    worker; otherwise only workers of those stages, the others keep `fixed_orders` as chains.
    `free_workers`, when given, names the re-optimised workers instead (planner/cpsat/lns.py).
    `max_period_ms` caps T (tests and what-if questions).
    `memory` and `symmetry` switch those families off (tests, experiments).
    """

    horizon_ms: float
    lower_bound_ms: float = 0.0
    scale: int = DEFAULT_SCALE
    free_stages: frozenset[int] | None = None
    free_workers: frozenset[WorkerId] | None = None
    max_period_ms: float | None = None
    memory: bool = True
    symmetry: bool = True

    @staticmethod
    def stages(stages: Iterable[int] | None) -> frozenset[int] | None:
        """Normalise a stage selection."""
        return None if stages is None else frozenset(stages)


def build_model(
    problem: Problem,
    options: BuildOptions,
    fixed_orders: Orders | None = None,
    frozen: FrozenTimes | None = None,
) -> CpSatVars:
    """The CP-SAT model of one steady-state iteration of period T (minimised).

    Workers outside `options.free_stages` keep `fixed_orders` as chains, or, when in `frozen`,
    their times as constants."""
    timing = IntTiming(problem, scale=options.scale)
    horizon = math.ceil(options.horizon_ms * options.scale)
    free = {w for w in problem.workers() if options.free_stages is None or w[1] in options.free_stages}
    if options.free_workers is not None:
        free = set(options.free_workers)
    v = new_vars(problem, timing, horizon, free, frozen)
    add_precedences(v)
    add_optimizer_steps(v)
    add_no_overlap(v, fixed_orders)
    lb = int(options.lower_bound_ms * options.scale + 1e-6)  # floor: never cut a real period off
    cap = None if options.max_period_ms is None else math.floor(options.max_period_ms * options.scale + 1e-6)
    add_windows(v, lb, cap)
    if options.memory:
        add_memory(v)
    if options.symmetry:
        add_symmetry_breaking(v)
    v.model.minimize(v.period)
    return v
