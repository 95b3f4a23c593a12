"""Integer time units for the CP-SAT model: every duration and delay of a Problem, scaled and rounded up.

Rounding up keeps the model conservative (a model schedule is never tighter than the real one).
`exact` records whether every scaled figure was already an integer; only then is the model's
objective bound also a valid lower bound on the real period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.problem import Problem, WorkerId

DEFAULT_SCALE = 10_000  # model units per ms (0.1 us): the example profiles are exact at this scale
_EPS = 1e-6  # tolerance, in model units, for float noise before rounding


@dataclass
class IntTiming:
    """Scaled integer durations (per worker and op), hop delays and all-reduce times of a Problem."""

    problem: Problem
    scale: int = DEFAULT_SCALE
    exact: bool = True
    _dur: dict[tuple[int, int, str], int] = field(default_factory=dict)

    def units(self, ms: float) -> int:
        """`ms` in model units, rounded up; clears `exact` when rounding changed the value."""
        x = ms * self.scale
        up = math.ceil(x - _EPS)
        if abs(up - x) > _EPS:
            self.exact = False
        return max(up, 0)

    def to_ms(self, units: float) -> float:
        """Model units back to milliseconds."""
        return units / self.scale

    def duration(self, op: str, worker: WorkerId) -> int:
        """Duration of `op` on `worker` = (d, s), slow factor included."""
        d, s = worker
        key = (d, s, op)
        if key not in self._dur:
            self._dur[key] = self.units(self.problem.duration(op, d, s))
        return self._dur[key]

    def hop(self, host_a: int, host_b: int) -> int:
        """Delay of an activation/gradient hop between hosts in pipelines host_a and host_b."""
        return self.units(self.problem.hop_ms(host_a, host_b))

    def allreduce(self, stage: int) -> int:
        """All-reduce time of `stage`."""
        return self.units(self.problem.job.allreduce_ms(stage))
