"""The first-F conflict term of the memory-aware bound (docs/planner.md section 2, issue 13).

Where stage f lost k workers, its D-k alive workers run the Fs of all D*M micro-batches. Take any
later stage b and, for each of its workers u that hosts micro-batches, the micro-batch x_u of u's
first F in iteration k (distinct for distinct u). Every F of iteration k at stage f starts at least
the F path after the earliest stage-0 OPT end O0(k); on each worker of stage f all but the first of
the x_u it runs start at least one F (f's duration, fastest alive peer: `delta`) later. So at least
a - (D - k) of the a hosting workers of stage b start their first F `delta` late, and the round-trip
chain of bounds.around_ms (F path, the worker's n F+B pairs and warm-up idle, B path, stage-0 W,
all-reduce, OPT) holds for each with `delta` added for the late ones. The schedule picks the
allocation and which workers are late: the bound is the least, over the number z of stage-b workers
that host nothing and over allocations, of the largest chain. Counted where the alive peers of b run
at one speed, per pair of stages f < b (without a capacity every hosted F is admitted before the
first B, as in the warm-up idle).
"""

from __future__ import annotations

import bisect

from planner.contract import JobSpec


def first_f_conflict_ms(
    job: JobSpec,
    factors: list[dict[int, float]],
    lost: dict[int, int],
    around: list[float],
    tail: list[float],
) -> float:
    """The conflict term: `lost[f]` failed workers per stage, `factors[s]` the alive peers' slow
    factors, `around`/`tail` as in bounds.memory_bound (stage 0's cycle outside a stage-b worker;
    F+B of the stages from s on, fastest peers, hops)."""
    total = job.num_pipelines * job.num_microbatches
    best = 0.0
    for f, k in lost.items():
        if k == 0 or not factors[f]:
            continue
        delta = job.stages[f].forward * min(factors[f].values())
        for b in range(f + 1, job.num_stages):
            cap, prof = job.capacity_mib(b), job.stages[b]
            if len(set(factors[b].values())) != 1:
                continue
            phi = next(iter(factors[b].values()))
            fits = total if cap is None or prof.activation_mib <= 0 else int(cap // prof.activation_mib)
            trip = prof.forward * phi + tail[b + 1]
            # Every worker hosting its share, delta late, is an allocation; a chain grows by at least
            # B per micro-batch, so no worker of an allocation below that hosts more than `most`.
            step = prof.backward_input * phi
            most = -(-total // len(factors[b])) + (int(delta / step) + 2 if step > 0 else total)
            costs = [0.0] + [  # the round-trip chain of a worker hosting n (nondecreasing in n)
                around[b]
                + n * (prof.forward + prof.backward_input) * phi
                + max(0.0, trip - min(fits, n) * prof.forward * phi)
                for n in range(1, min(total, most) + 1)
            ]
            best = max(best, _least_max(costs, delta, len(factors[b]), len(factors[f]), total))
    return best


def _least_max(costs: list[float], delta: float, workers: int, alive_f: int, total: int) -> float:
    """min over z idle workers of the least V such that the a = workers - z hosting ones, at least
    max(0, a - alive_f) of them late by `delta`, can host `total` micro-batches within V."""

    def cap(v: float) -> int:  # most micro-batches a worker hosts with chain <= v
        return bisect.bisect_right(costs, v + 1e-9) - 1

    values = sorted(set(costs) | {c + delta for c in costs})
    best = float("inf")
    for z in range(workers):
        a = workers - z
        if a * (len(costs) - 1) < total:  # the rest cannot host everything within the cost list
            break
        late = max(0, a - alive_f)

        def fits(v: float, a: int = a, late: int = late) -> bool:
            return late * max(0, cap(v - delta)) + (a - late) * max(0, cap(v)) >= total

        lo, hi = 0, len(values) - 1
        if not fits(values[hi]):
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(values[mid]):
                hi = mid
            else:
                lo = mid + 1
        best = min(best, values[lo])
    return 0.0 if best == float("inf") else best
