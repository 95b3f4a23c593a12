"""Pydantic models of the three wire documents of CONTRACT.md: job spec, failure scenario, schedule.

This is the one place those documents are defined. Importing it must stay cheap (no ortools, no
torch): workers and the service read schedules through it. Times are milliseconds, memory MiB,
indices 0-based. Extra fields are kept (CONTRACT.md welcomes optional extensions).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, model_validator

from planner.errors import InvalidInputError, UnrecoverableScenarioError

Worker = tuple[NonNegativeInt, NonNegativeInt]
"""A worker `[d, s]`: pipeline d, stage s."""

MicroBatch = tuple[NonNegativeInt, NonNegativeInt]
"""A micro-batch `[d, m]`: the m-th micro-batch of pipeline d's share of the global batch."""

OpName = Literal["F", "B", "W", "BW", "OPT"]

SCHEDULE_FORMAT = "recycle-schedule/1"

# Bounds that keep a job spec plannable on one machine; a spec past them is refused, not attempted.
MAX_PIPELINES = 1024
MAX_STAGES = 1024
MAX_MICROBATCHES = 4096


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class StageProfile(_Doc):
    """Profile of one pipeline stage: op durations (ms) and memory per micro-batch (MiB)."""

    forward: NonNegativeFloat = Field(description="Duration of one micro-batch's F at this stage, ms.")
    backward_input: NonNegativeFloat = Field(
        description="Duration of B (input-gradient backward), ms. A fused BW takes B + W."
    )
    backward_weight: NonNegativeFloat = Field(description="Duration of W (weight-gradient backward), ms.")
    optimizer: NonNegativeFloat = Field(description="Duration of the optimizer step in OPT, ms.")
    activation_mib: NonNegativeFloat = Field(
        description="Memory a micro-batch holds on its host from the start of its F to the end of its B/BW."
    )
    weight_grad_mib: NonNegativeFloat = Field(
        description="Memory a micro-batch holds from the end of its B to the end of its W."
    )


class Comm(_Doc):
    """Communication costs (ms)."""

    activation_ms: NonNegativeFloat = Field(
        description="Moving an activation or gradient between consecutive stages in the same pipeline."
    )
    cross_pipeline_ms: NonNegativeFloat = Field(
        description="The same hop when the two hosts are in different pipelines (re-routed hops)."
    )
    allreduce_ms: NonNegativeFloat | list[NonNegativeFloat] = Field(
        description="A stage's gradient all-reduce among its alive peers: one number or one per stage."
    )


class JobSpec(_Doc):
    """A training job: D pipelines x P stages, M micro-batches per pipeline, per-stage profiles."""

    name: str = Field(min_length=1, description="Job name; schedules refer to it in `job`.")
    num_pipelines: int = Field(ge=1, le=MAX_PIPELINES, description="D, data-parallel pipelines.")
    num_stages: int = Field(ge=1, le=MAX_STAGES, description="P, pipeline stages.")
    num_microbatches: int = Field(ge=1, le=MAX_MICROBATCHES, description="M, micro-batches per pipeline.")
    stages: list[StageProfile] = Field(description="Exactly num_stages profiles; entry s profiles stage s.")
    comm: Comm = Field(description="Communication costs.")
    memory_capacity_mib: NonNegativeFloat | list[NonNegativeFloat] | None = Field(
        default=None,
        description="Peak memory per worker for activations and deferred weight gradients "
        "(one number or one per stage); absent means unlimited.",
    )

    @model_validator(mode="after")
    def _check_lengths(self) -> JobSpec:
        p = self.num_stages
        if len(self.stages) != p:
            raise ValueError(f"stages: has {len(self.stages)} entries but num_stages is {p}")
        if isinstance(self.comm.allreduce_ms, list) and len(self.comm.allreduce_ms) != p:
            raise ValueError(
                f"comm.allreduce_ms: has {len(self.comm.allreduce_ms)} entries but num_stages is {p}"
            )
        if isinstance(self.memory_capacity_mib, list) and len(self.memory_capacity_mib) != p:
            raise ValueError(
                f"memory_capacity_mib: has {len(self.memory_capacity_mib)} entries but num_stages is {p}"
            )
        return self

    def allreduce_ms(self, stage: int) -> float:
        """All-reduce time of `stage`."""
        ar = self.comm.allreduce_ms
        return float(ar[stage]) if isinstance(ar, list) else float(ar)

    def capacity_mib(self, stage: int) -> float | None:
        """Memory capacity of a worker of `stage`, or None when unlimited."""
        cap = self.memory_capacity_mib
        if cap is None:
            return None
        return float(cap[stage]) if isinstance(cap, list) else float(cap)


class SlowWorker(_Doc):
    """An alive worker whose every op takes `factor` times its profiled time."""

    worker: Worker = Field(description="The slow worker [d, s].")
    factor: float = Field(gt=0, le=1000, description="Multiplier on every op duration of this worker.")


class FailureScenario(_Doc):
    """Which workers are gone (and which are slow)."""

    failed: list[Worker] = Field(default_factory=list, description="Failed workers [d, s].")
    slow: list[SlowWorker] = Field(default_factory=list, description="Alive workers that run slower.")

    @model_validator(mode="after")
    def _check_duplicates(self) -> FailureScenario:
        seen: set[tuple[int, ...]] = set()
        for i, w in enumerate(self.failed):
            if tuple(w) in seen:
                raise ValueError(f"failed[{i}]: worker {list(w)} is listed twice")
            seen.add(tuple(w))
        slow_seen: set[tuple[int, ...]] = set()
        for i, sw in enumerate(self.slow):
            if tuple(sw.worker) in seen:
                raise ValueError(f"slow[{i}]: worker {list(sw.worker)} is also listed as failed")
            if tuple(sw.worker) in slow_seen:
                raise ValueError(f"slow[{i}]: worker {list(sw.worker)} is listed twice")
            slow_seen.add(tuple(sw.worker))
        return self

    def check_against(self, job: JobSpec) -> None:
        """Raise InvalidInputError for workers outside the job's grid, and
        UnrecoverableScenarioError when some stage has no alive worker."""
        d_max, p_max = job.num_pipelines, job.num_stages
        for label, workers in (("failed", self.failed), ("slow", [s.worker for s in self.slow])):
            for i, (d, s) in enumerate(workers):
                if d >= d_max or s >= p_max:
                    raise InvalidInputError(
                        f"{label}[{i}]: worker [{d}, {s}] is outside the job's grid "
                        f"({d_max} pipelines x {p_max} stages)"
                    )
        dead_per_stage: dict[int, int] = {}
        for _, s in self.failed:
            dead_per_stage[s] = dead_per_stage.get(s, 0) + 1
        lost = [s for s, n in dead_per_stage.items() if n >= d_max]
        if lost:
            raise UnrecoverableScenarioError(lost)

    def slow_factor(self, worker: tuple[int, int]) -> float:
        """The slow factor of `worker` (1.0 when it is not slow)."""
        for sw in self.slow:
            if tuple(sw.worker) == tuple(worker):
                return float(sw.factor)
        return 1.0


class Action(_Doc):
    """One entry of a worker's order."""

    op: OpName = Field(description="F, B, W, BW or OPT.")
    mb: MicroBatch | None = Field(default=None, description="The micro-batch [d, m]; absent for OPT.")
    start_ms: float = Field(default=0.0, description="Predicted start in the first iteration (informative).")
    end_ms: float = Field(default=0.0, description="Predicted end in the first iteration (informative).")

    @model_validator(mode="after")
    def _check_mb(self) -> Action:
        if self.op == "OPT" and self.mb is not None:
            raise ValueError("OPT takes no mb")
        if self.op != "OPT" and self.mb is None:
            raise ValueError(f"{self.op} needs mb")
        return self


class WorkerSchedule(_Doc):
    """One alive worker's order for one iteration."""

    worker: Worker = Field(description="The worker [d, s].")
    actions: list[Action] = Field(description="The order, executed front to back, ending with one OPT.")


class Schedule(_Doc):
    """A per-worker order for one iteration, repeated every iteration (CONTRACT.md section 3)."""

    format: Literal["recycle-schedule/1"] = Field(
        default="recycle-schedule/1", description="Document format."
    )
    job: str = Field(description="Name of the job spec this schedule is for.")
    failed: list[Worker] = Field(default_factory=list, description="The failure set it was planned for.")
    iteration_time_ms: float = Field(ge=0, description="Predicted steady-state time per iteration (replay).")
    workers: list[WorkerSchedule] = Field(description="Every alive worker exactly once.")
    slow: list[SlowWorker] | None = Field(
        default=None, description="Optional: the slow workers it was planned for."
    )
    strategy: str | None = Field(default=None, description="Optional: which planner or baseline made it.")
    replay_iterations: int | None = Field(
        default=None,
        ge=4,
        description="Optional: the K of CONTRACT.md section 4 that iteration_time_ms was replayed with.",
    )

    def scenario(self) -> FailureScenario:
        """The failure scenario this schedule states it was planned for."""
        return FailureScenario(failed=list(self.failed), slow=list(self.slow or []))
