"""Checkpoint-restart (CheckFreq's model): periodic checkpoints, and on failure a restart.

Steady state: periodic checkpoints every `tau` seconds of training, each blocking `delta` seconds.
On a failure the job loses the work since the last checkpoint plus a restart cost `R`, then runs
on spares (full job, failure-free 1F1B) or, without spares, on the remaining machines: the
pipelines that are fully alive, which is the shrink configuration (planner's `1f1b-survivors`).

Interval (Young 1974; Daly 2006, first order): tau = sqrt(2 * delta * M) - delta for delta < M/2,
else tau = M, with M the job's mean time between failures.
Expected fraction of time training (used for the calibration in docs/strategies.md):
    1 - delta / (tau + delta) - (tau / 2 + R) / M.
"""

from __future__ import annotations

import math

from planner.contract import FailureScenario, JobSpec
from whatif.strategies.base import Costs, Outcome, Strategy
from whatif.strategies.shrink import Shrink


def young_daly_interval_s(mtbf_s: float, checkpoint_s: float) -> float:
    """Daly's first-order optimum checkpoint interval (seconds of work between checkpoints)."""
    if mtbf_s <= 0 or checkpoint_s <= 0:
        raise ValueError("MTBF and checkpoint cost must be positive")
    if checkpoint_s >= mtbf_s / 2:
        return mtbf_s
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) - checkpoint_s


def restart_efficiency(mtbf_s: float, checkpoint_s: float, restart_s: float, interval_s: float) -> float:
    """Expected fraction of wall time spent training under checkpoint-restart with spares."""
    ckpt = checkpoint_s / (interval_s + checkpoint_s)
    return max(0.0, 1.0 - ckpt - (interval_s / 2.0 + restart_s) / mtbf_s)


class CheckpointRestart(Strategy):
    """Restart from the last checkpoint on every failure; spares or the remaining machines after."""

    name = "checkpoint-restart"
    summary = "periodic checkpoints (Young/Daly); restart on failure"
    restarts = True

    def __init__(self, job: JobSpec, costs: Costs, shrink: Shrink | None = None) -> None:
        super().__init__(job, costs)
        self.shrink = shrink or Shrink(job, costs)

    @property
    def switch_s(self) -> float:
        return self.costs.restart_s

    def evaluate(self, scenario: FailureScenario) -> Outcome:
        if self.costs.spares or not scenario.failed:
            return self.shrink.outcome(FailureScenario())
        return self.shrink.outcome(scenario)
