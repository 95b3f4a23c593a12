"""The planner's own error types.

Only the API and CLI layers turn these into HTTP statuses or exit codes; every message names the
offending worker, stage or field so a user can act on it.
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base class for every error the planner raises on purpose."""


class InvalidInputError(PlannerError, ValueError):
    """A job spec, failure scenario or schedule that breaks a rule of CONTRACT.md."""


class UnrecoverableScenarioError(PlannerError):
    """A failure set that leaves some stage with no alive worker: re-routing cannot help.

    The job has to restore from a checkpoint; the error names the stage(s) that are gone.
    """

    def __init__(self, stages: list[int]) -> None:
        self.stages = sorted(stages)
        if len(self.stages) == 1:
            gone = f"stage {self.stages[0]} has no alive worker"
        else:
            gone = f"stages {', '.join(str(s) for s in self.stages)} have no alive worker"
        super().__init__(
            f"unrecoverable failure set: {gone} (every data-parallel peer failed); restore from a checkpoint"
        )


class ScheduleRuleError(PlannerError):
    """A schedule that breaks a rule of CONTRACT.md section 3 or 4.

    `rule` is a short stable identifier (for tests and machines); the message says exactly what broke.
    """

    def __init__(self, rule: str, message: str) -> None:
        self.rule = rule
        self.message = message
        super().__init__(f"[{rule}] {message}")
