"""The per-worker load bound on the iteration time, and the allocation that reaches it.

Per iteration every micro-batch passes every stage once, so the alive peers of stage s share
D*M micro-batches' F+B+W. A worker that hosts n of them is busy n*(f+b+w)*factor, then waits the
all-reduce and runs its OPT before its next iteration can start, so its period is at least
n*(f+b+w)*factor + allreduce + optimizer*factor. The iteration time is at least the largest period
of any worker, minimised over the integer allocations of micro-batches to peers: without slow
workers that is ceil(D*M / alive_s) micro-batches on the busiest peer.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from planner.contract import FailureScenario, JobSpec


@dataclass(frozen=True)
class StageBound:
    """Load bound of one stage: the iteration time its busiest peer needs, and the allocation."""

    stage: int
    bound_ms: float
    counts: dict[int, int]  # alive pipeline d -> micro-batches hosted by worker [d, stage]


def allocate_stage(
    job: JobSpec, scenario: FailureScenario, stage: int, prefer: Sequence[int] | None = None
) -> StageBound:
    """Split the stage's D*M micro-batches over its alive peers so the slowest peer's period is least.

    Greedy min-max: each micro-batch goes to the peer whose period with it is least. The periods
    grow with the count, so this is optimal: if it ever gave a peer a period above the optimum, every
    peer would already hold as many micro-batches as the optimum lets it, and they would all be
    placed. (The OPT counts: a slow peer's longer OPT can make a fast peer the better host even
    when its F+B+W load is already higher.) Ties (which peers take the micro-batches that do not
    divide evenly) go to pipelines early in `prefer` (default: ascending index).
    """
    rank = {d: i for i, d in enumerate(prefer)} if prefer is not None else {}
    prof = job.stages[stage]
    work = prof.forward + prof.backward_input + prof.backward_weight
    failed = {tuple(w) for w in scenario.failed}
    alive = [d for d in range(job.num_pipelines) if (d, stage) not in failed]
    factors = {d: scenario.slow_factor((d, stage)) for d in alive}
    counts = {d: 0 for d in alive}
    heap = [((work + prof.optimizer) * factors[d], rank.get(d, d), d) for d in alive]
    heapq.heapify(heap)
    for _ in range(job.num_pipelines * job.num_microbatches):
        _, r, d = heapq.heappop(heap)
        counts[d] += 1
        heapq.heappush(heap, (((counts[d] + 1) * work + prof.optimizer) * factors[d], r, d))
    ar = job.allreduce_ms(stage)
    bound = max(counts[d] * work * factors[d] + ar + prof.optimizer * factors[d] for d in alive)
    return StageBound(stage=stage, bound_ms=bound, counts=counts)


def load_bound(job: JobSpec, scenario: FailureScenario) -> float:
    """Lower bound on the iteration time of any valid schedule for this job and scenario (ms)."""
    return max(allocate_stage(job, scenario, s).bound_ms for s in range(job.num_stages))


def warmup_idle_ms(job: JobSpec, scenario: FailureScenario, stage: int, factor: float, hosted: int) -> float:
    """Idle a worker of `stage` cannot avoid at the start of each iteration under its memory capacity.

    Its iteration starts with an empty memory (every W ran before its OPT). Until its first B, only
    Fs can run (a B needs its micro-batch's round trip through the later stages; a W needs a B), and
    at most floor(capacity / activation) of them fit. The first B starts no earlier than one round
    trip after the first F: its own F, then F and B at every later stage with the fastest alive peer,
    plus the cheapest hop each way. What the admitted Fs do not cover of that round trip is idle
    (without a capacity every hosted F is admitted).
    """
    cap = job.capacity_mib(stage)
    prof = job.stages[stage]
    if hosted == 0:
        return 0.0
    trip = prof.forward * factor + return_trip_ms(job, scenario, stage)
    admitted = (
        hosted if cap is None or prof.activation_mib <= 0 else min(int(cap // prof.activation_mib), hosted)
    )
    return max(0.0, trip - admitted * prof.forward * factor)


def return_trip_ms(job: JobSpec, scenario: FailureScenario, stage: int) -> float:
    """Least time from the end of a micro-batch's F at `stage` to the start of its B there: F and B
    at every later stage with its fastest alive peer, plus the cheapest hop each way."""
    failed = {tuple(w) for w in scenario.failed}
    hop = min(job.comm.activation_ms, job.comm.cross_pipeline_ms)
    trip = 0.0
    for later in range(stage + 1, job.num_stages):
        fastest = min(
            scenario.slow_factor((d, later)) for d in range(job.num_pipelines) if (d, later) not in failed
        )
        trip += (job.stages[later].forward + job.stages[later].backward_input) * fastest + 2 * hop
    return trip


def memory_bound(job: JobSpec, scenario: FailureScenario) -> float:
    """A tighter lower bound than `load_bound` where memory is tight or micro-batches are few.

    A worker of stage s hosting n micro-batches has a period of at least its load, all-reduce and
    optimizer plus its warm-up idle (`warmup_idle_ms` with `hosted=n`): round trip minus the
    min(n, capacity / activation) Fs that can cover it. That cost never decreases with n (one more
    micro-batch adds F+B+W and covers at most one F of idle), so the greedy min-max allocation on it
    is optimal over all allocations, and its busiest worker bounds the period of the stage.
    Without a memory capacity all n Fs may run before the first B (the idle counts where n Fs do not
    cover the round trip: few micro-batches per pipeline). A worker of a later stage also bounds
    stage 0's cycle, which must wrap around its F+B pairs (`around_ms`), one F longer for some
    workers of a stage after one that lost workers (planner/bounds_conflict.py); docs/planner.md
    section 2 derives both.
    """
    failed = {tuple(w) for w in scenario.failed}
    num_d, num_s = job.num_pipelines, job.num_stages
    hop = min(job.comm.activation_ms, job.comm.cross_pipeline_ms)
    factors = [
        {d: scenario.slow_factor((d, s)) for d in range(num_d) if (d, s) not in failed} for s in range(num_s)
    ]
    tail = [0.0] * (num_s + 1)  # tail[s]: F+B at stages s.. with their fastest alive peer, hops
    for s in reversed(range(num_s)):
        prof = job.stages[s]
        fastest = min(factors[s].values(), default=1.0)  # a stage with no alive worker: no bound here
        tail[s] = tail[s + 1] + (prof.forward + prof.backward_input) * fastest + 2 * hop
    around = around_ms(job, factors, hop)
    best = 0.0
    for s in range(num_s):
        if not factors[s]:
            continue
        prof, cap = job.stages[s], job.capacity_mib(s)
        work = prof.forward + prof.backward_input + prof.backward_weight
        fits = 10**9 if cap is None or prof.activation_mib <= 0 else int(cap // prof.activation_mib)

        def cost(d: int, n: int, s: int = s, work: float = work, fits: int = fits) -> float:
            phi = factors[s][d]
            trip = job.stages[s].forward * phi + tail[s + 1]
            idle = 0.0 if n == 0 else max(0.0, trip - min(fits, n) * job.stages[s].forward * phi)
            own = n * work * phi + idle + job.stages[s].optimizer * phi + job.allreduce_ms(s)
            if s == 0 or n == 0:
                return own
            pair = job.stages[s].forward + job.stages[s].backward_input  # the round-trip term
            return max(own, around[s] + n * pair * phi + idle)

        if len(set(factors[s].values())) == 1:  # identical peers: the busiest hosts ceil(total/alive)
            busiest = -(-num_d * job.num_microbatches // len(factors[s]))
            best = max(best, cost(next(iter(factors[s])), busiest))
            continue
        counts = dict.fromkeys(factors[s], 0)
        heap = [(cost(d, 1), d) for d in counts]
        heapq.heapify(heap)
        top = max(cost(d, 0) for d in counts)
        for _ in range(num_d * job.num_microbatches):
            c, d = heapq.heappop(heap)
            counts[d] += 1
            top = max(top, c)
            heapq.heappush(heap, (cost(d, counts[d] + 1), d))
        best = max(best, top)
    lost: dict[int, int] = {}
    for _, s in failed:
        lost[s] = lost.get(s, 0) + 1
    if lost:  # the first-F conflict at a stage that lost workers (planner/bounds_conflict.py)
        from planner.bounds_conflict import first_f_conflict_ms

        best = max(best, first_f_conflict_ms(job, factors, lost, around, tail))
    return best


def around_ms(job: JobSpec, factors: list[dict[int, float]], hop: float) -> list[float]:
    """around[s]: the least time stage 0's cycle spends outside a worker of stage s >= 1.

    Every F of iteration k starts after the earliest stage-0 OPT end O0(k); so the worker's first F
    starts at least the F path (F at stages 0..s-1, fastest alive peers, a hop each) after O0(k).
    From its first F to its last B it runs n F+B and waits its warm-up idle (`warmup_idle_ms`).
    That B's micro-batch then needs B at stages s-1..0 (hops), W at stage 0, the all-reduce and
    the stage-0 OPT before any stage-0 worker starts iteration k+1 (docs/planner.md section 2).
    """
    fast = [min(f.values(), default=1.0) for f in factors]
    prof = job.stages
    around = [0.0] * job.num_stages
    for s in range(1, job.num_stages):
        p = prof[s - 1]
        around[s] = around[s - 1] + (p.forward + p.backward_input) * fast[s - 1] + 2 * hop
    end = (prof[0].backward_weight + prof[0].optimizer) * fast[0] + job.allreduce_ms(0)
    return [a + end for a in around]
