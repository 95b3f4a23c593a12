"""The planning problem: a validated job and scenario seen as workers, hosts, durations and delays.

Every schedule generator (baselines, greedy, CP-SAT) works on a `Problem`. The validator does not:
it re-derives everything from the documents, so it can reject what the generators got wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.bounds import allocate_stage
from planner.contract import FailureScenario, JobSpec

WorkerId = tuple[int, int]  # (d, s)
MicroBatchId = tuple[int, int]  # (d, m)


@dataclass
class Problem:
    """Derived view of (job, scenario). Build it with `Problem.build`; it checks the scenario."""

    job: JobSpec
    scenario: FailureScenario
    alive: list[list[int]]  # alive[s] = alive pipelines at stage s, ascending
    factor: dict[WorkerId, float]
    host: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (s, d, m) -> host pipeline

    @property
    def num_pipelines(self) -> int:
        return self.job.num_pipelines

    @property
    def num_stages(self) -> int:
        return self.job.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.job.num_microbatches

    @classmethod
    def build(
        cls,
        job: JobSpec,
        scenario: FailureScenario,
        balanced: bool = True,
        prefer: Sequence[int] | None = None,
    ) -> Problem:
        """Check the scenario against the job and derive alive sets, slow factors and hosts.

        `balanced` hosts re-routed micro-batches (and those a slow worker sheds) by the allocation
        that reaches the load bound; otherwise each failed worker's micro-batches are dealt
        round-robin to its alive peers and nothing else moves (naive re-route). `prefer` orders
        the pipelines whose workers take the micro-batches that do not divide evenly.
        """
        scenario.check_against(job)
        failed = {tuple(w) for w in scenario.failed}
        alive = [[d for d in range(job.num_pipelines) if (d, s) not in failed] for s in range(job.num_stages)]
        factor = {(d, s): scenario.slow_factor((d, s)) for s in range(job.num_stages) for d in alive[s]}
        prob = cls(job=job, scenario=scenario, alive=alive, factor=factor)
        for s in range(job.num_stages):
            if balanced:
                prob._assign_balanced(s, prefer)
            else:
                prob._assign_round_robin(s)
        return prob

    def _assign_round_robin(self, s: int) -> None:
        alive = self.alive[s]
        k = 0
        for d in range(self.num_pipelines):
            for m in range(self.num_microbatches):
                if d in alive:
                    self.host[s, d, m] = d
                else:
                    self.host[s, d, m] = alive[k % len(alive)]
                    k += 1

    def _assign_balanced(self, s: int, prefer: Sequence[int] | None) -> None:
        counts = allocate_stage(self.job, self.scenario, s, prefer).counts
        rank: dict[int, int] = {d: i for i, d in enumerate(prefer)} if prefer is not None else {}
        M = self.num_microbatches
        pool: list[tuple[int, int]] = []  # (m, d) micro-batches without a host yet
        need: dict[int, int] = {}
        for d in range(self.num_pipelines):
            keep = min(counts.get(d, 0), M)
            for m in range(M):
                if m < keep:
                    self.host[s, d, m] = d
                else:
                    pool.append((m, d))
            if d in counts and counts[d] > M:
                need[d] = counts[d] - M
        pool.sort()
        quota = dict(need)
        for m, d in pool:
            # Deal in micro-batch order to the peer with the most left to take: spreads each
            # peer's extra work evenly over the iteration.
            best = max(quota, key=lambda p: (quota[p] / need[p], -rank.get(p, int(p))))
            self.host[s, d, m] = best
            quota[best] -= 1

    # --- durations and delays -------------------------------------------------------------
    def duration(self, op: str, d: int, s: int) -> float:
        """Duration of `op` on worker [d, s], slow factor included."""
        prof = self.job.stages[s]
        base = {
            "F": prof.forward,
            "B": prof.backward_input,
            "W": prof.backward_weight,
            "BW": prof.backward_input + prof.backward_weight,
            "OPT": prof.optimizer,
        }[op]
        return base * self.factor[d, s]

    def hop_ms(self, host_a: int, host_b: int) -> float:
        """Delay of an activation/gradient hop between hosts in pipelines host_a and host_b."""
        comm = self.job.comm
        return comm.activation_ms if host_a == host_b else comm.cross_pipeline_ms

    def microbatches_on(self, d: int, s: int) -> list[MicroBatchId]:
        """Micro-batches hosted by worker [d, s], in (m, d) order (one pass over the host map:
        callers that need every worker use `hosted_by_worker`)."""
        return self.hosted_by_worker().get((d, s), [])

    def hosted_by_worker(self) -> dict[WorkerId, list[MicroBatchId]]:
        """Micro-batches hosted by every alive worker, each list in (m, d) order."""
        index: dict[WorkerId, list[MicroBatchId]] = {w: [] for w in self.workers()}
        for (s, d, m), h in self.host.items():
            hosted = index.get((h, s))
            assert hosted is not None, (
                f"micro-batch [{d}, {m}] at stage {s} is hosted by failed worker [{h}, {s}]"
            )
            hosted.append((d, m))
        for lst in index.values():
            lst.sort(key=lambda x: (x[1], x[0]))
        return index

    def workers(self) -> list[WorkerId]:
        """Every alive worker, ordered by stage then pipeline."""
        return [(d, s) for s in range(self.num_stages) for d in self.alive[s]]
