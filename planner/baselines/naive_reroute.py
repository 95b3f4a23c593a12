"""Naive re-route baseline: failed workers' micro-batches dealt round-robin to alive peers, 1F1B.

Hosts come from `Problem.build(balanced=False)`: a failed worker's micro-batches go round-robin to
the alive peers of its stage, and nothing else moves. Every alive worker then runs 1F1B with fused
BW over ALL the micro-batches it hosts (its own and the re-routed ones) in micro-batch order. A
host serving two pipelines needs a deeper warm-up than P-s-1, or its downstream neighbours starve
and the pipelines deadlock; the index-keyed 1F1B of `one_f_one_b` sizes it exactly: before the BW
of micro-batch index m, the F of every hosted micro-batch with index <= m + P-s-1 (proof there).
Failure-free this is plain 1F1B, and under failures it is what the `1f1b` baseline runs too.
"""

from __future__ import annotations

from planner.baselines.one_f_one_b import build_orders, build_problem

__all__ = ["build_orders", "build_problem"]
