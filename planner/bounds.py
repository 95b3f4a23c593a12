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

    Greedy min-max: each micro-batch goes to the peer whose period grows least, which is optimal
    for identical jobs on uniformly related machines. Ties (which peers take the micro-batches that
    do not divide evenly) go to pipelines early in `prefer` (default: ascending index).
    """
    rank = {d: i for i, d in enumerate(prefer)} if prefer is not None else {}
    prof = job.stages[stage]
    work = prof.forward + prof.backward_input + prof.backward_weight
    failed = {tuple(w) for w in scenario.failed}
    alive = [d for d in range(job.num_pipelines) if (d, stage) not in failed]
    factors = {d: scenario.slow_factor((d, stage)) for d in alive}
    counts = {d: 0 for d in alive}
    heap = [(work * factors[d], rank.get(d, d), d) for d in alive]
    heapq.heapify(heap)
    for _ in range(job.num_pipelines * job.num_microbatches):
        _, r, d = heapq.heappop(heap)
        counts[d] += 1
        heapq.heappush(heap, ((counts[d] + 1) * work * factors[d], r, d))
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
    plus the cheapest hop each way. What the admitted Fs do not cover of that round trip is idle.
    """
    cap = job.capacity_mib(stage)
    prof = job.stages[stage]
    if cap is None or prof.activation_mib <= 0 or hosted == 0:
        return 0.0
    failed = {tuple(w) for w in scenario.failed}
    hop = min(job.comm.activation_ms, job.comm.cross_pipeline_ms)
    trip = prof.forward * factor
    for later in range(stage + 1, job.num_stages):
        fastest = min(
            scenario.slow_factor((d, later)) for d in range(job.num_pipelines) if (d, later) not in failed
        )
        trip += (job.stages[later].forward + job.stages[later].backward_input) * fastest + 2 * hop
    admitted = min(int(cap // prof.activation_mib), hosted)
    return max(0.0, trip - admitted * prof.forward * factor)


def memory_bound(job: JobSpec, scenario: FailureScenario) -> float:
    """A tighter lower bound than `load_bound` where memory is tight.

    Every worker's period is its load, all-reduce and optimizer, plus its warm-up idle
    (`warmup_idle_ms`). Any allocation's busiest worker is at least as loaded as the balanced
    allocation's, and every worker of the stage idles at least the least warm-up idle any of its
    peers could have (hosting enough micro-batches to fill its memory), so their sum bounds the period.
    """
    best = 0.0
    for s in range(job.num_stages):
        alloc = allocate_stage(job, scenario, s)
        idle = min(
            warmup_idle_ms(job, scenario, s, scenario.slow_factor((d, s)), hosted=10**9) for d in alloc.counts
        )
        best = max(best, alloc.bound_ms + idle)
    return best
