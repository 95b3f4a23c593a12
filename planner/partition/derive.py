"""A job re-partitioned: the stage-level job spec the planner and simulator take unchanged, and the
migration from the job's own partition (CONTRACT extension of issue 12, docs/contract.md).

Stage s of the derived job holds layers [a, b): its op durations and per-micro-batch memory are its
extras (what the job's stage s has beyond its own layers) plus the sum of the held layers'; its
optimizer time and all-reduce scale with the parameters it holds (their param_mib; the layer count
when no layer has any); its memory capacity for activations is the job's, minus the parameters and
optimizer state of layers it gained, plus those of layers it gave away.

A stage may hold no layer (an empty range [a, a], issue 12 follow-up): its F/B/W are its extras
alone (for derived per-layer figures: the embedding / head on the first / last stage, 0 on a
middle one), its optimizer time and all-reduce scale to 0 with its parameters (one already empty
in the job's partition keeps its own), and activations and gradients still pass through its
workers, one hop each way.
"""

from __future__ import annotations

from planner.contract import FailureScenario, JobSpec, LayerMove, Migration, StageProfile, check_partition
from planner.errors import InvalidInputError
from planner.partition.layers import LAYER_FIELDS, LayerModel, layer_model


class PartitionMemoryError(InvalidInputError):
    """A stage of a partition whose layers' parameters and optimizer state exceed its capacity (bad
    input to the planner; a schedule carrying such a partition breaks the memory rule)."""


def _ratio(model: LayerModel, s: int, a: int, b: int) -> float:
    a0, b0 = model.partition[s]
    old = sum(x.param_mib for x in model.layers[a0:b0])
    if old > 0:
        return sum(x.param_mib for x in model.layers[a:b]) / old
    if b0 > a0:
        return (b - a) / (b0 - a0)
    if b > a:  # a derived job's empty stage: its optimizer and all-reduce have no per-layer scale
        raise InvalidInputError(
            f"partition: stage {s} holds no layer in the job's partition, so its optimizer and "
            f"all-reduce times cannot be scaled to layers [{a}, {b}); derive from the original job"
        )
    return 1.0  # it stays empty: its own figures (derive_job(job, job's partition) is job itself)


def stage_profile(job: JobSpec, model: LayerModel, s: int, a: int, b: int) -> StageProfile:
    """Stage s's profile when it holds layers [a, b)."""
    fig = {
        f: max(0.0, model.extras[s][f] + sum(getattr(x, f) for x in model.layers[a:b])) for f in LAYER_FIELDS
    }
    return StageProfile(**fig, optimizer=job.stages[s].optimizer * _ratio(model, s, a, b))


def stage_capacity(job: JobSpec, model: LayerModel, s: int, a: int, b: int) -> float | None:
    """Stage s's capacity for activations when it holds layers [a, b) (None: unlimited)."""
    cap = job.capacity_mib(s)
    if cap is None:
        return None
    a0, b0 = model.partition[s]
    return cap + model.resident_mib(a0, b0) - model.resident_mib(a, b)


def derive_job(job: JobSpec, partition: list[list[int]], model: LayerModel | None = None) -> JobSpec:
    """The stage-level job spec of `job` running with `partition` (the job itself when `partition`
    is its own). InvalidInputError for a bad map, or a stage whose layers' parameters and optimizer
    state leave it no memory for activations."""
    model = model or layer_model(job)
    partition = check_partition(partition, model.num_layers, job.num_stages, allow_empty=True)
    if partition == model.partition:
        return job
    stages, caps, allreduce = [], [], []
    for s, (a, b) in enumerate(partition):
        stages.append(stage_profile(job, model, s, a, b))
        allreduce.append(job.allreduce_ms(s) * _ratio(model, s, a, b))
        cap = stage_capacity(job, model, s, a, b)
        if cap is not None and cap < 0:
            raise PartitionMemoryError(
                f"memory_capacity_mib: stage {s} cannot hold layers [{a}, {b}): their parameters and "
                f"optimizer state exceed its capacity by {-cap:.1f} MiB"
            )
        caps.append(cap)
    data = job.model_dump(mode="json")
    data["stages"] = [p.model_dump(mode="json") for p in stages]
    data["comm"]["allreduce_ms"] = allreduce
    data["memory_capacity_mib"] = None if job.memory_capacity_mib is None else caps
    data["partition"] = partition
    if any(b == a for a, b in partition):  # a job spec leaves a stage empty only beside given layers
        data["layers"] = [x.model_dump(mode="json") for x in model.layers]
    return JobSpec.model_validate(data)


def migration(
    job: JobSpec,
    partition: list[list[int]],
    model: LayerModel | None = None,
    source: list[list[int]] | None = None,
    scenario: FailureScenario | None = None,
) -> Migration:
    """The layer moves from `source` (default: the job's partition) to `partition` (the same in
    every pipeline), the MiB moved per pipeline and the estimated time.

    What moves is what the runtime sends (runtime_adapter/migration.py): parameters (half of
    `param_mib`, which also counts the gradient buffer, empty between iterations) and optimizer
    state. Each pipeline's copy comes from that pipeline's old holder; the copies of pipelines whose
    old holder failed (`scenario`) all come from one live peer, which sends them one after the
    other. Senders run in parallel, so the estimate is the busiest sender's MiB over the link
    bandwidth: (1 + failed workers of stage f) x the MiB stage f gives away, maximized over f."""
    model = model or layer_model(job)
    old = [s for s, (a, b) in enumerate(source or model.partition) for _ in range(a, b)]
    new = [s for s, (a, b) in enumerate(partition) for _ in range(a, b)]
    moves: list[LayerMove] = []
    for layer, (f, t) in enumerate(zip(old, new, strict=True)):
        if f == t:
            continue
        last = moves[-1] if moves else None
        if last and last.layers[1] == layer and (last.from_stage, last.to_stage) == (f, t):
            last.layers = (last.layers[0], layer + 1)
        else:
            moves.append(LayerMove(layers=(layer, layer + 1), from_stage=f, to_stage=t))
    given: dict[int, float] = {}
    for m in moves:
        given[m.from_stage] = given.get(m.from_stage, 0.0) + model.moved_mib(m.layers[0], m.layers[1])
    failed = [s for _, s in scenario.failed] if scenario is not None else []
    busiest = max(((1 + failed.count(f)) * mib for f, mib in given.items()), default=0.0)
    return Migration(moves=moves, mib=sum(given.values()), estimated_ms=busiest / model.migration_mib_per_ms)
