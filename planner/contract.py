"""Pydantic models of the three wire documents of CONTRACT.md: job spec, failure scenario, schedule.

This is the one place those documents are defined. Importing it must stay cheap (no ortools, no
torch): workers and the service read schedules through it. Times are milliseconds, memory MiB,
indices 0-based. Extra fields are kept (CONTRACT.md welcomes optional extensions).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    model_validator,
)

from planner.errors import InvalidInputError, UnrecoverableScenarioError

MAX_TOTAL = 1e30  # an iteration's summed ms or MiB: far beyond any job, far below float overflow

Index = Annotated[int, Strict(), Field(ge=0)]
"""A 0-based index: an integer, not `true`, `"1"` or `1.0` (a boolean read as 1 once failed a stage)."""

Amount = Annotated[float, Strict(), Field(ge=0)]
"""A duration (ms) or size (MiB): a number, not `true` or `"1"`; an integer is a number."""

Worker = tuple[Index, Index]
"""A worker `[d, s]`: pipeline d, stage s."""

MicroBatch = tuple[Index, Index]
"""A micro-batch `[d, m]`: the m-th micro-batch of pipeline d's share of the global batch."""

OpName = Literal["F", "B", "W", "BW", "OPT"]

SCHEDULE_FORMAT = "recycle-schedule/1"

# Bounds that keep a job spec plannable on one machine; a spec past them is refused, not attempted.
MAX_PIPELINES = 1024
MAX_STAGES = 1024
MAX_MICROBATCHES = 4096


class _Doc(BaseModel):
    # NaN and Infinity (which Python's json reads) are refused in every number: no figure of the
    # contract is infinite, and an infinite duration or capacity only turns into NaN downstream.
    model_config = ConfigDict(extra="allow", populate_by_name=True, allow_inf_nan=False)


class StageProfile(_Doc):
    """Profile of one pipeline stage: op durations (ms) and memory per micro-batch (MiB)."""

    forward: Amount = Field(description="Duration of one micro-batch's F at this stage, ms.")
    backward_input: Amount = Field(
        description="Duration of B (input-gradient backward), ms. A fused BW takes B + W."
    )
    backward_weight: Amount = Field(description="Duration of W (weight-gradient backward), ms.")
    optimizer: Amount = Field(description="Duration of the optimizer step in OPT, ms.")
    activation_mib: Amount = Field(
        description="Memory a micro-batch holds on its host from the start of its F to the end of its B/BW."
    )
    weight_grad_mib: Amount = Field(
        description="Memory a micro-batch holds from the end of its B to the end of its W."
    )


class LayerProfile(_Doc):
    """Profile of one model layer (optional job-spec field `layers`, issue 12): op durations (ms),
    memory per micro-batch (MiB) and the resident memory of its parameters and optimizer state."""

    forward: Amount = Field(description="This layer's share of a micro-batch's F, ms.")
    backward_input: Amount = Field(description="Its share of B, ms.")
    backward_weight: Amount = Field(description="Its share of W, ms.")
    activation_mib: Amount = Field(description="Its share of a micro-batch's activations.")
    weight_grad_mib: Amount = Field(description="Its share of a deferred weight gradient.")
    param_mib: Amount = Field(default=0.0, description="Parameters + their gradient buffer.")
    optimizer_state_mib: Amount = Field(default=0.0, description="e.g. Adam's moments.")


def _extra_error(field: str, exc: ValidationError) -> ValueError:
    err = exc.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    return ValueError(f"{field}{'.' + where if where else ''}: {err['msg']}")


def check_partition(
    value: object, num_layers: int, num_stages: int, field: str = "partition", allow_empty: bool = False
) -> list[list[int]]:
    """Validate a layer-to-stage map: P half-open ranges covering 0..num_layers-1 contiguously, each
    stage holding >= 1 layer, or, with `allow_empty` (a schedule's partition, a derived job's), >= 0
    (an empty range [a, a]: the stage runs only its extras). Raises InvalidInputError naming the
    layer or stage."""
    if not isinstance(value, list) or len(value) != num_stages:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise InvalidInputError(f"{field}: needs {num_stages} ranges (one per stage), got {got}")
    ranges: list[list[int]] = []
    for s, r in enumerate(value):
        ok = isinstance(r, list | tuple) and len(r) == 2
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in r):
            raise InvalidInputError(f"{field}: stage {s}: needs a range [first, end), got {r!r}")
        a, b = int(r[0]), int(r[1])
        if b < a:
            raise InvalidInputError(f"{field}: stage {s}: range [{a}, {b}) ends before it starts")
        if b == a and not allow_empty:
            raise InvalidInputError(f"{field}: stage {s} holds no layer ([{a}, {b}))")
        if b == a and not 0 <= a <= num_layers:
            raise InvalidInputError(f"{field}: stage {s}: empty range [{a}, {b}) is outside 0..{num_layers}")
        if a < 0 or b > num_layers:
            bad = a if a < 0 else b - 1
            raise InvalidInputError(f"{field}: layer {bad} of stage {s} is outside 0..{num_layers - 1}")
        ranges.append([a, b])
    holder: dict[int, int] = {}
    for s, (a, b) in enumerate(ranges):
        for layer in range(a, b):
            if layer in holder:
                raise InvalidInputError(f"{field}: layer {layer} is held by stages {holder[layer]} and {s}")
            holder[layer] = s
    for layer in range(num_layers):
        if layer not in holder:
            raise InvalidInputError(f"{field}: layer {layer} is held by no stage")
    for s in range(1, num_stages):
        if ranges[s][0] != ranges[s - 1][1]:
            raise InvalidInputError(
                f"{field}: stage {s} does not start where stage {s - 1} ends (not contiguous)"
            )
    return ranges


class Comm(_Doc):
    """Communication costs (ms)."""

    # Optional extra `migration_mib_per_ms` (issue 12; absent: derived, planner/partition/layers.py):
    # link bandwidth for moving a layer's parameters and optimizer state between workers.

    activation_ms: Amount = Field(
        description="Moving an activation or gradient between consecutive stages in the same pipeline."
    )
    cross_pipeline_ms: Amount = Field(
        description="The same hop when the two hosts are in different pipelines (re-routed hops)."
    )
    allreduce_ms: Amount | list[Amount] = Field(
        description="A stage's gradient all-reduce among its alive peers: one number or one per stage."
    )

    @model_validator(mode="after")
    def _check_migration(self) -> Comm:
        extra = self.__pydantic_extra__ or {}
        bw = extra.get("migration_mib_per_ms")
        if bw is not None:
            if (
                isinstance(bw, bool)
                or not isinstance(bw, int | float)
                or not bw > 0
                or bw != bw
                or bw == float("inf")
            ):
                raise ValueError(f"comm.migration_mib_per_ms: must be a positive finite number, got {bw!r}")
            extra["migration_mib_per_ms"] = float(bw)
        return self


class JobSpec(_Doc):
    """A training job: D pipelines x P stages, M micro-batches per pipeline, per-stage profiles."""

    name: str = Field(min_length=1, description="Job name; schedules refer to it in `job`.")
    num_pipelines: int = Field(ge=1, le=MAX_PIPELINES, strict=True, description="D, data-parallel pipelines.")
    num_stages: int = Field(ge=1, le=MAX_STAGES, strict=True, description="P, pipeline stages.")
    num_microbatches: int = Field(
        ge=1, le=MAX_MICROBATCHES, strict=True, description="M, micro-batches per pipeline."
    )
    stages: list[StageProfile] = Field(description="Exactly num_stages profiles; entry s profiles stage s.")
    comm: Comm = Field(description="Communication costs.")
    memory_capacity_mib: Amount | list[Amount] | None = Field(
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
        self._check_magnitude()
        self._check_layers()
        return self

    def _check_magnitude(self) -> None:
        """An iteration's total time and memory must be finite floats: 1e308 ms per op is finite, but
        D*M of them is not, and the figures turned into NaN downstream (a 500 in the service)."""
        slots = self.num_pipelines * self.num_microbatches
        comm = self.comm
        ar = comm.allreduce_ms if isinstance(comm.allreduce_ms, list) else [comm.allreduce_ms]
        total = sum(
            slots * (st.forward + st.backward_input + st.backward_weight) + st.optimizer for st in self.stages
        )
        total += sum(ar) + slots * self.num_stages * 2 * max(comm.activation_ms, comm.cross_pipeline_ms)
        mem = sum(slots * (st.activation_mib + st.weight_grad_mib) for st in self.stages)
        if not (math.isfinite(total) and math.isfinite(mem) and total < MAX_TOTAL and mem < MAX_TOTAL):
            raise ValueError(
                f"stages: the figures are too large (one iteration would take {total:.3g} ms and hold "
                f"{mem:.3g} MiB); give milliseconds and MiB"
            )

    def _check_layers(self) -> None:
        """Optional issue-12 extras `layers` (per-layer profiles) and `partition` (layer map)."""
        extra = self.__pydantic_extra__ or {}
        layers = extra.get("layers")
        if layers is not None:
            if not isinstance(layers, list) or not layers:
                raise ValueError("layers: must be a non-empty list of per-layer profiles")
            parsed = []
            for i, x in enumerate(layers):
                try:
                    parsed.append(LayerProfile.model_validate(x).model_dump(mode="json"))
                except ValidationError as exc:
                    raise _extra_error(f"layers[{i}]", exc) from None
            extra["layers"] = parsed
        part = extra.get("partition")
        if part is not None:
            n = self.num_layers()
            if n is None:
                raise ValueError("partition: needs `layers` or `model.layers` (how many layers there are)")
            try:
                # A stage may hold no layer only beside given per-layer figures (a derived job of
                # planner.partition): with derived ones, 0 layers cannot share a stage's figures.
                extra["partition"] = check_partition(part, n, self.num_stages, allow_empty=layers is not None)
            except InvalidInputError as exc:
                raise ValueError(str(exc)) from None
        elif layers is not None and len(layers) < self.num_stages:
            raise ValueError(f"layers: {len(layers)} layers cannot fill {self.num_stages} stages")

    def num_layers(self) -> int | None:
        """How many layers the model has: len(layers), else model.layers, else None."""
        extra = self.__pydantic_extra__ or {}
        if extra.get("layers"):
            return len(extra["layers"])
        model = extra.get("model")
        n = model.get("layers") if isinstance(model, dict) else None
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= self.num_stages else None

    def layer_profiles(self) -> list[LayerProfile] | None:
        """The given per-layer profiles (None when absent; planner.partition derives them)."""
        layers = (self.__pydantic_extra__ or {}).get("layers")
        return None if layers is None else [LayerProfile.model_validate(x) for x in layers]

    def partition_ranges(self) -> list[list[int]] | None:
        """The given layer-to-stage map (None when absent)."""
        part = (self.__pydantic_extra__ or {}).get("partition")
        return None if part is None else [list(r) for r in part]

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
    factor: Annotated[float, Strict()] = Field(
        gt=0, le=1000, description="Multiplier on every op duration of this worker."
    )


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

    def check_grid(self, job: JobSpec) -> None:
        """Raise InvalidInputError for a failed or slow worker outside the job's grid."""
        d_max, p_max = job.num_pipelines, job.num_stages
        for label, workers in (("failed", self.failed), ("slow", [s.worker for s in self.slow])):
            for i, (d, s) in enumerate(workers):
                if d >= d_max or s >= p_max:
                    raise InvalidInputError(
                        f"{label}[{i}]: worker [{d}, {s}] is outside the job's grid "
                        f"({d_max} pipelines x {p_max} stages)"
                    )

    def check_against(self, job: JobSpec) -> None:
        """Raise InvalidInputError for workers outside the job's grid, and
        UnrecoverableScenarioError when some stage has no alive worker."""
        self.check_grid(job)
        d_max = job.num_pipelines
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


class LayerMove(_Doc):
    """Layers [a, b) move from `from_stage` to `to_stage` in every pipeline."""

    layers: tuple[Index, Index] = Field(description="Half-open layer range [a, b).")
    from_stage: Index = Field(description="The stage that holds them in the job's partition.")
    to_stage: Index = Field(description="The stage that holds them in this schedule's.")


class Migration(_Doc):
    """What a schedule's partition moves relative to the job's (per pipeline) and how long it takes."""

    moves: list[LayerMove] = Field(default_factory=list, description="Moved layer ranges.")
    mib: Amount = Field(description="Parameters + optimizer state moved per pipeline, MiB.")
    estimated_ms: Amount = Field(
        description="The busiest sender's MiB (a live peer also sends the copies of its failed peers' "
        "pipelines) over comm.migration_mib_per_ms, ms."
    )


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

    @model_validator(mode="after")
    def _check_partition(self) -> Schedule:
        """Optional issue-12 extras: `partition` (checked against the job by planner.partition; a
        stage may hold no layer, an empty range [a, a]) and `migration` ({"moves": [...], "mib",
        "estimated_ms"})."""
        extra = self.__pydantic_extra__ or {}
        part = extra.get("partition")
        if part is not None:
            # the layer count: the last non-empty range's end (an empty one may name any index)
            ends = [r[1] for r in part if isinstance(r, list | tuple) and len(r) == 2 and r[0] != r[1]]
            n = max((e for e in ends if isinstance(e, int)), default=0)
            num_stages = len(part) if isinstance(part, list) else 0
            extra["partition"] = check_partition(part, n, num_stages, allow_empty=True)
        mig = extra.get("migration")
        if mig is not None:
            try:
                extra["migration"] = Migration.model_validate(mig).model_dump(mode="json")
            except ValidationError as exc:
                raise _extra_error("migration", exc) from None
        return self

    def partition_ranges(self) -> list[list[int]] | None:
        """The layer map this schedule runs with (None: the job's own)."""
        part = (self.__pydantic_extra__ or {}).get("partition")
        return None if part is None else [list(r) for r in part]

    def scenario(self) -> FailureScenario:
        """The failure scenario this schedule states it was planned for."""
        return FailureScenario(failed=list(self.failed), slow=list(self.slow or []))
