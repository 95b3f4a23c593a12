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


def nearest_k_figure(latest: list[float], steady: SteadyState, claim: float) -> tuple[int, float] | None:
    """(K, k_figure at K) with K >= 4 whose figure is nearest to `claim`, over every K: the replayed
    ones, and past them (settled, period c, a = c * iteration_time_ms) the figure at
    K = i + 1 + j*c is (E[i] + j*a - E[0]) / (i + j*c), whose nearest j is solved for."""
    n, c = len(latest), steady.period
    ks = set(range(4, n + 1))
    if steady.settled and 0 < c < n:
        a = c * steady.iteration_time_ms
        for i in range(n - c, n):
            denom = claim * c - a  # j * (claim*c - a) = E[i] - E[0] - claim*i
            guess = (latest[i] - latest[0] - claim * i) / denom if denom else 0.0
            if not 0 <= guess < 2**40:  # negative, inf or NaN (a claim equal to the limit)
                guess = 0.0 if guess < 0 else 2.0**40
            ks.update(i + 1 + j * c for j in (0, 1, int(guess), int(guess) + 1))
    best: tuple[int, float] | None = None
    for k in sorted(x for x in ks if x >= 4):
        fig = k_figure(latest, steady, k)
        if fig is not None and (best is None or abs(fig - claim) < abs(best[1] - claim)):
            best = (k, fig)
    return best


def k_figure(latest: list[float], steady: SteadyState, k: int) -> float | None:
    """The K-iteration figure (CONTRACT.md section 4) at `k` >= 2: `latest` holds the latest OPT end
    of each iteration replayed; past them a settled replay repeats with its period c, shifted by
    c * iteration_time_ms, so E[i + j*c] = E[i] + j*c*iteration_time_ms. None when `k` lies past an
    unsettled replay."""
    n, c = len(latest), steady.period
    if k <= n:
        return (latest[k - 1] - latest[0]) / (k - 1)
    if not steady.settled or c <= 0 or n <= c:
        return None
    j, i = divmod(k - 1 - (n - c), c)  # iteration k-1 (0-based) = (n - c + i) + j*c
    end = latest[n - c + i] + j * c * steady.iteration_time_ms
    return (end - latest[0]) / (k - 1)
