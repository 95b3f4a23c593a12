"""What every strategy model shares: recovery costs, the outcome of a failure set, memoization.

A strategy model maps a failure set to the steady-state iteration time it would run at (or to
"fatal": it cannot continue without restarting from a checkpoint). Every strategy processes the
whole global batch (D*M micro-batches) per iteration, so throughput is 1 / iteration time.
Transient costs (lost work, restarts, reconfiguration) are `Costs`, charged by `whatif.events`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from planner.contract import FailureScenario, JobSpec
from planner.normalize import normalize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Costs:
    """Recovery costs in seconds (assumptions, documented in docs/strategies.md)."""

    checkpoint_s: float = 30.0  # blocking write of one checkpoint (delta in Young/Daly)
    restart_s: float = 300.0  # restart from a checkpoint: reschedule, reload, re-warm (R)
    reroute_s: float = 10.0  # recycle: detect the failure, switch to a precomputed plan
    failover_s: float = 10.0  # Bamboo: detect, fail over to the redundant copy
    reconfig_s: float = 30.0  # shrink / Oobleck: rebuild communicators, re-form pipelines, move weights
    checkpoint_interval_s: float | None = None  # None: Young/Daly from the MTBF
    spares: bool = False  # a restart replaces failed workers from a spare pool


@dataclass(frozen=True)
class Outcome:
    """A strategy's steady state under one failure set; iteration_time_ms None means fatal."""

    iteration_time_ms: float | None
    reason: str = ""

    @property
    def fatal(self) -> bool:
        return self.iteration_time_ms is None


class Strategy:
    """Base class: subclasses set `name`, `summary`, `switch_s` and implement `evaluate`.

    `switch_s` is the stall when the strategy absorbs a failure or a rejoin without a restart
    (None: it always restarts from a checkpoint, like checkpoint-restart).
    """

    name = "strategy"
    summary = ""
    restarts = False

    def __init__(self, job: JobSpec, costs: Costs) -> None:
        self.job = job
        self.costs = costs
        self._memo: dict[str, Outcome] = {}

    @property
    def switch_s(self) -> float:
        return self.costs.reconfig_s

    def evaluate(self, scenario: FailureScenario) -> Outcome:
        """Uncached model evaluation (scenario is in canonical form)."""
        raise NotImplementedError

    def replays(self, scenario: FailureScenario) -> tuple[str, ...]:
        """The planner.baselines schedules `evaluate(scenario)` would replay (scenario canonical; a
        warm cache needs none): whatif/prefetch.py computes them ahead, in processes."""
        return ()

    def outcome(self, scenario: FailureScenario) -> Outcome:
        """Memoized by normalized key: strategies are invariant under pipeline permutations."""
        norm = normalize(self.job, scenario)
        hit = self._memo.get(norm.key)
        if hit is None:
            hit = self.evaluate(norm.scenario)
            self._memo[norm.key] = hit
            log.debug("%s %s -> %s", self.name, [list(w) for w in norm.scenario.failed], hit)
        return hit


def lost_stages(job: JobSpec, scenario: FailureScenario) -> list[int]:
    """Stages with no alive worker (re-routing cannot help there)."""
    count: dict[int, int] = {}
    for _, s in scenario.failed:
        count[s] = count.get(s, 0) + 1
    return sorted(s for s, n in count.items() if n >= job.num_pipelines)
