"""Shrink (TorchElastic / torchft behaviour): drop every pipeline that lost a worker.

The survivors take the dropped pipelines' micro-batches (the global batch is kept), each running
classic 1F1B over a longer list: planner.baselines' `1f1b-survivors`, replayed by the simulator.
Fatal when no pipeline is fully alive. Source: torchft's per-step quorum (survivors continue without
a restart); TorchElastic proper restarts from a checkpoint, which is `checkpoint-restart` here.
"""

from __future__ import annotations

from whatif.strategies.recycle import BaselineSchedule


class Shrink(BaselineSchedule):
    """1F1B on the fully-alive pipelines only; the others' micro-batches spread over them."""

    name = "shrink"
    summary = "drop pipelines that lost a worker; survivors take their micro-batches (1F1B)"
    baseline, barrier = "1f1b-survivors", False

    @property
    def switch_s(self) -> float:
        return self.costs.reconfig_s
