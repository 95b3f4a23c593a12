"""Bamboo-style recovery (Thorpe et al., NSDI '23): redundant computation, failover to the copy.

Model: worker [d, s] also holds stage s+1's layers (the last stage holds stage 0's: a ring) and
runs their forward every micro-batch (redundant computation, charged in full: the model does not
hide it in bubbles), so the failure-free F of stage s is F_s + F_{s+1}. When [d, s] fails its
predecessor [d, s-1] runs both stages (F, B, W, OPT and all-reduce of both) and keeps the
redundant forward of the stage after the merged block. Fatal when two consecutive stages of one
pipeline (ring order) fail. Each pipeline keeps its M micro-batches; each distinct pipeline shape
is replayed by the simulator as a one-pipeline job, and the iteration time is the slowest
pipeline's (the all-reduce is synchronous). A merged block that contains stage 0 (because stage 0
failed) is placed last in the pipeline: an approximation of the ring.
"""

from __future__ import annotations

from planner.contract import FailureScenario
from whatif.strategies.base import Outcome, Strategy
from whatif.strategies.pipeline import Block, pipeline_time_ms, stage_block


class Bamboo(Strategy):
    """Redundant forward of the next stage on every worker; predecessor takes over on failure."""

    name = "bamboo"
    summary = "redundant next-stage forward on every worker; predecessor fails over"

    @property
    def switch_s(self) -> float:
        return self.costs.failover_s

    def pipeline_blocks(self, failed_stages: set[int]) -> list[Block] | None:
        """The stages of one pipeline after failover, or None when two consecutive stages failed."""
        num_p = self.job.num_stages
        if num_p > 1 and any((s - 1) % num_p in failed_stages for s in failed_stages):
            return None
        if num_p == 1 and failed_stages:
            return None
        blocks = []
        for a in range(num_p):
            if a in failed_stages:
                continue
            block = stage_block(self.job, a)
            nxt = (a + 1) % num_p
            if nxt in failed_stages:
                block = block.plus(stage_block(self.job, nxt))
                nxt = (nxt + 1) % num_p
            if num_p > 1:
                block = block.plus(stage_block(self.job, nxt), forward_only=True)
            blocks.append(block)
        return blocks

    def evaluate(self, scenario: FailureScenario) -> Outcome:
        job = self.job
        by_pipeline: dict[int, set[int]] = {d: set() for d in range(job.num_pipelines)}
        for d, s in scenario.failed:
            by_pipeline[d].add(s)
        times = []
        shapes: dict[tuple[int, ...], int] = {}  # distinct failed-stage sets -> first pipeline with it
        for d in sorted(by_pipeline, reverse=True):
            shapes[tuple(sorted(by_pipeline[d]))] = d
        for stages, d in sorted(shapes.items()):
            blocks = self.pipeline_blocks(set(stages))
            if blocks is None:
                return Outcome(None, f"pipeline {d} lost consecutive stages {list(stages)}")
            times.append(pipeline_time_ms(job, blocks, job.num_microbatches))
        return Outcome(max(times))
