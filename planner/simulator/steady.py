"""The steady-state iteration time of a replay: the limit of the K-iteration figure as K grows.

Iteration k+1 depends on iteration k only through each worker's free time, which is the end of
its own OPT (its last op): the vector x(k) of OPT ends per worker. One iteration maps x(k) to
x(k+1) by sums and maxima only (a max-plus linear map), so it is monotone and commutes with
adding a constant to every entry. Hence once x(k) = x(k-c) + a for every worker, the replay
repeats from then on, shifted by `a` every `c` iterations, and the time per iteration is exactly
`a / c` for every later K: the limit of `(E[K-1] - E[0]) / (K-1)` (E = the latest OPT end). The
map is also non-expansive in the max norm, so an agreement within `eps` (float noise) puts the
limit within `eps / c` of `a / c`.

The replay is extended one iteration at a time until such a `c` (the period, >1 when the orders
settle into alternating iterations) is found, or until the cap, where the time is estimated from
the last half of the run and `settled` is False.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

STEADY_TOLERANCE = 1e-10  # relative to the largest OPT end compared: far above float noise
MAX_PERIOD = 32
MAX_ITERATIONS = 128  # the cap; on the shipped instances the replay settles within 20


@dataclass(frozen=True)
class SteadyState:
    """Where a replay's OPT ends settle: `iteration_time_ms` per iteration, the OPT ends repeating
    (shifted) every `period` iterations once `iterations` iterations were replayed."""

    iteration_time_ms: float
    period: int
    iterations: int  # iterations replayed to find it
    settled: bool  # False: the cap was reached; iteration_time_ms is an estimate


def find_period(history: list[list[float]], max_period: int = MAX_PERIOD) -> tuple[int, float] | None:
    """(c, a) with history[-1] = history[-1-c] + a in every entry (within the tolerance), the
    smallest such c, or None."""
    last = history[-1]
    eps = STEADY_TOLERANCE * max(1.0, max(abs(x) for x in last))
    for c in range(1, min(max_period, len(history) - 1) + 1):
        before = history[-1 - c]
        shift = last[0] - before[0]
        lo, hi = shift - eps, shift + eps
        if all(lo <= x - y <= hi for x, y in zip(last, before, strict=True)):
            return c, shift
    return None


def settle(
    history: list[list[float]],
    step: Callable[[], list[float]],
    max_iterations: int = MAX_ITERATIONS,
) -> SteadyState:
    """Extend `history` (OPT ends per worker of the iterations replayed so far, at least one) with
    `step()` (the next iteration's) until it repeats, or until `max_iterations` iterations."""
    for k in range(1, len(history) + 1):  # the iterations already replayed may settle already
        found = find_period(history[:k])
        if found is not None:
            return SteadyState(found[1] / found[0], found[0], k, True)
    while len(history) < max_iterations:
        history.append(step())
        found = find_period(history)
        if found is not None:
            return SteadyState(found[1] / found[0], found[0], len(history), True)
    half = len(history) // 2
    latest = [max(x) for x in history]
    estimate = (latest[-1] - latest[half - 1]) / (len(history) - half) if half >= 1 else 0.0
    return SteadyState(estimate, 0, len(history), False)
