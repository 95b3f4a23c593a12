"""Oobleck-style recovery (Jang et al., SOSP '23): re-form pipelines from the surviving workers.

Model: the N surviving workers are regrouped into as many pipelines as before (x = D, fewer only
when a pipeline would not fit in memory), of balanced depths (N // x or N // x + 1 workers), the
layers re-partitioned for each depth (whole layers, minimizing the slowest stage, from the
per-stage profile; a depth-P pipeline keeps the spec's partition, so no failures means the job as
specified), and the global batch of D*M micro-batches dealt to pipelines in proportion to speed
(each next micro-batch to the pipeline whose 1F1B estimate (m + depth - 1) * slowest stage + hops
+ slowest OPT grows least). The pipelines are replayed by the simulator and the iteration time is
the slowest pipeline's (the all-reduce is synchronous). A depth whose 1F1B activation peak exceeds
the job's memory capacity is not used. Fatal when every worker of some stage failed (no copy of
those layers' parameters survives) or when no grouping fits in memory.
"""

from __future__ import annotations

import heapq

from planner.contract import FailureScenario, JobSpec
from whatif.strategies.base import Costs, Outcome, Strategy, lost_stages
from whatif.strategies.pipeline import (
    Block,
    min_capacity_mib,
    peak_1f1b_mib,
    pipeline_time_ms,
    repartition,
    stage_block,
    units_per_stage,
)


def _estimate_ms(blocks: list[Block], m: int, hop_ms: float) -> float:
    slowest = max(b.compute_ms for b in blocks)
    opt = max(b.optimizer + b.allreduce_ms for b in blocks)
    return (m + len(blocks) - 1) * slowest + 2 * (len(blocks) - 1) * hop_ms + opt


class Oobleck(Strategy):
    """Heterogeneous pipelines over all surviving workers, batch split by pipeline speed."""

    name = "oobleck"
    summary = "re-form pipelines of balanced depths from survivors; batch split by speed"

    def __init__(self, job: JobSpec, costs: Costs) -> None:
        super().__init__(job, costs)
        self._blocks: dict[int, list[Block] | None] = {}
        self._configs: dict[int, list[tuple[int, int]] | None] = {}  # num_alive -> configure()
        self.last_config: list[tuple[int, int]] = []  # (depth, micro-batches) of the chosen pipelines

    def blocks(self, depth: int) -> list[Block] | None:
        """The re-partitioned stages for `depth`, or None when it cannot hold the model."""
        if depth not in self._blocks:
            job = self.job
            if depth > job.num_stages * units_per_stage(job):
                self._blocks[depth] = None
            elif depth == job.num_stages:
                self._blocks[depth] = [stage_block(job, s) for s in range(job.num_stages)]
            else:
                self._blocks[depth] = repartition(job, depth)
        return self._blocks[depth]

    def _fits(self, blocks: list[Block], m: int) -> bool:
        cap = min_capacity_mib(self.job)
        return cap is None or max(peak_1f1b_mib(blocks, m)) <= cap * (1 + 1e-9)

    def configure(self, num_alive: int) -> list[tuple[int, int]] | None:
        """(depth, micro-batches) per pipeline with the most pipelines that fit, or None (it depends
        on the number of alive workers only: remembered per number)."""
        if num_alive not in self._configs:
            self._configs[num_alive] = self._configure(num_alive)
        config = self._configs[num_alive]
        return None if config is None else list(config)

    def _configure(self, num_alive: int) -> list[tuple[int, int]] | None:
        job, total = self.job, self.job.num_pipelines * self.job.num_microbatches
        hop = job.comm.activation_ms
        for x in range(min(job.num_pipelines, num_alive), 0, -1):
            q, r = divmod(num_alive, x)
            depths = [q + 1] * r + [q] * (x - r)
            parts = [self.blocks(p) for p in depths]
            if any(b is None for b in parts):
                continue
            counts = [0] * x
            heap = [(_estimate_ms(b, 1, hop), i) for i, b in enumerate(parts) if b is not None]
            heapq.heapify(heap)
            for _ in range(total):
                _, i = heapq.heappop(heap)
                counts[i] += 1
                heapq.heappush(heap, (_estimate_ms(parts[i], counts[i] + 1, hop), i))  # type: ignore[arg-type]
            if not all(self._fits(b, m) for b, m in zip(parts, counts, strict=True) if b is not None):
                continue
            return list(zip(depths, counts, strict=True))  # as many pipelines as fit
        return None

    def evaluate(self, scenario: FailureScenario) -> Outcome:
        job = self.job
        lost = lost_stages(job, scenario)
        if lost:
            return Outcome(None, f"every copy of stage(s) {lost}'s layers is gone")
        num_alive = job.num_pipelines * job.num_stages - len(scenario.failed)
        config = self.configure(num_alive)
        if config is None:
            return Outcome(None, f"no pipeline depth over {num_alive} workers fits in memory")
        self.last_config = config
        times = []
        for depth, m in sorted(set(config)):
            chosen = self.blocks(depth)
            assert chosen is not None
            times.append(pipeline_time_ms(job, chosen, m))
        depths = sorted({d for d, _ in config})
        return Outcome(max(times), f"{len(config)} pipelines of depth {depths}")
