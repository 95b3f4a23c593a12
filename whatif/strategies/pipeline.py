"""Single pipelines built from a job's per-stage profile, timed by the simulator.

Oobleck-style and Bamboo-style recovery change the shape of individual pipelines (depth, which
layers a worker holds). Each distinct pipeline is written as a one-pipeline job spec (D=1) and its
classic 1F1B schedule replayed by planner.simulator; the all-reduce of each new stage keeps the
job's per-stage figure for the layers it holds.

Layer granularity: see layer_units; a re-partition moves whole units.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from planner.contract import Comm, FailureScenario, JobSpec, StageProfile
from planner.partition.layers import lightest_split

_FIELDS = ("forward", "backward_input", "backward_weight", "optimizer", "activation_mib", "weight_grad_mib")


@dataclass(frozen=True)
class Block:
    """Summed profile of some layers, plus their all-reduce time."""

    forward: float
    backward_input: float
    backward_weight: float
    optimizer: float
    activation_mib: float
    weight_grad_mib: float
    allreduce_ms: float

    @property
    def compute_ms(self) -> float:
        return self.forward + self.backward_input + self.backward_weight

    def plus(self, other: Block, forward_only: bool = False) -> Block:
        """This block with `other`'s layers added (only their forward when forward_only)."""
        if forward_only:
            return replace(self, forward=self.forward + other.forward)
        vals = {f: getattr(self, f) + getattr(other, f) for f in (*_FIELDS, "allreduce_ms")}
        return Block(**vals)

    def scaled(self, k: float) -> Block:
        return Block(**{f: getattr(self, f) * k for f in (*_FIELDS, "allreduce_ms")})


def stage_block(job: JobSpec, s: int) -> Block:
    """The job's stage `s` as a block."""
    p = job.stages[s]
    return Block(**{f: float(getattr(p, f)) for f in _FIELDS}, allreduce_ms=job.allreduce_ms(s))


def units_per_stage(job: JobSpec) -> int:
    """How many movable units (layers) one stage of the job holds."""
    model = getattr(job, "model", None)
    layers = model.get("layers") if isinstance(model, dict) else None
    if isinstance(layers, int) and layers >= job.num_stages:
        return max(1, layers // job.num_stages)
    return 1


def layer_units(job: JobSpec) -> list[Block]:
    """The job's layers as movable units: each stage is `units_per_stage` equal layers of the
    lightest stage's profile per layer (planner.partition.layers.lightest_split, the planner's
    derived per-layer figures), and what a stage has beyond that (embedding, LM head) stays one
    indivisible lump on its first layer (its last layer for the last stage)."""
    u = units_per_stage(job)
    blocks = [asdict(stage_block(job, s)) for s in range(job.num_stages)]
    one, extras = lightest_split(blocks, [u] * job.num_stages)
    layer = Block(**one)
    units: list[Block] = []
    for s, excess in enumerate(extras):
        layers = [layer] * u
        at = u - 1 if s == job.num_stages - 1 and s > 0 else 0
        layers[at] = layer.plus(Block(**excess))
        units.extend(layers)
    return units


def repartition(job: JobSpec, depth: int) -> list[Block]:
    """Split the job's layers into `depth` contiguous stages minimizing the largest compute time."""
    units = layer_units(job)
    n = len(units)
    if not 1 <= depth <= n:
        raise ValueError(f"cannot split {n} layer units into {depth} stages")
    prefix = [0.0]
    for b in units:
        prefix.append(prefix[-1] + b.compute_ms)
    inf = float("inf")
    # best[i][j]: smallest max stage time splitting the first j units into i stages; cut for rebuild
    best = [[inf] * (n + 1) for _ in range(depth + 1)]
    cut = [[0] * (n + 1) for _ in range(depth + 1)]
    best[0][0] = 0.0
    for i in range(1, depth + 1):
        for j in range(i, n - (depth - i) + 1):
            for k in range(i - 1, j):
                v = max(best[i - 1][k], prefix[j] - prefix[k])
                if v < best[i][j] - 1e-12:
                    best[i][j], cut[i][j] = v, k
    bounds, j = [], n
    for i in range(depth, 0, -1):
        bounds.append((cut[i][j], j))
        j = cut[i][j]
    blocks = []
    for lo, hi in reversed(bounds):
        acc = units[lo]
        for b in units[lo + 1 : hi]:
            acc = acc.plus(b)
        blocks.append(acc)
    return blocks


def pipeline_job(job: JobSpec, blocks: tuple[Block, ...], num_microbatches: int) -> JobSpec:
    """A one-pipeline job spec whose stages are `blocks` (memory capacity dropped: checked apart)."""
    stages = [StageProfile(**{f: getattr(b, f) for f in _FIELDS}) for b in blocks]
    comm = Comm(
        activation_ms=job.comm.activation_ms,
        cross_pipeline_ms=job.comm.cross_pipeline_ms,
        allreduce_ms=[b.allreduce_ms for b in blocks],
    )
    return JobSpec(
        name=f"{job.name}-pipeline{len(blocks)}",
        num_pipelines=1,
        num_stages=len(blocks),
        num_microbatches=num_microbatches,
        stages=stages,
        comm=comm,
    )


@lru_cache(maxsize=4096)
def _pipeline_time(job_json: str, blocks: tuple[Block, ...], num_microbatches: int) -> float:
    from planner.baselines import baseline_schedule

    job = JobSpec.model_validate_json(job_json)
    single = pipeline_job(job, blocks, num_microbatches)
    return baseline_schedule("1f1b", single, FailureScenario()).iteration_time_ms


def pipeline_time_ms(job: JobSpec, blocks: list[Block], num_microbatches: int) -> float:
    """Steady iteration time of one pipeline made of `blocks` running 1F1B (fused BW) over
    `num_microbatches` micro-batches, replayed by the simulator (memoized)."""
    if num_microbatches <= 0:
        return 0.0
    return _pipeline_time(job.model_dump_json(), tuple(blocks), num_microbatches)


def peak_1f1b_mib(blocks: list[Block], num_microbatches: int) -> list[float]:
    """Activation peak per stage under 1F1B: stage i keeps min(depth - i, m) micro-batches in flight."""
    depth = len(blocks)
    return [min(depth - i, num_microbatches) * b.activation_mib for i, b in enumerate(blocks)]


def min_capacity_mib(job: JobSpec) -> float | None:
    """The smallest per-worker memory capacity of the job (None: unlimited)."""
    caps = [job.capacity_mib(s) for s in range(job.num_stages)]
    known = [c for c in caps if c is not None]
    return min(known) if known else None
