"""Per-layer figures of a job (issue 12): given in the job spec, or derived from its stage figures.

Given: the job spec's `layers` (and `partition`, else the default split below). Derived (when
`layers` is absent but `model.layers` is present): every layer gets the same figures, those of the
lightest stage per layer (`lightest_split`: per field, the least of a stage's figure over the layers
it holds; on the shipped GPT instances a middle stage's in every field), and what a stage has
beyond its layers' share (the embedding on the first stage, the LM head on the last) is its
`extras`, which stay on that stage under every partition, also when it holds no layer (the
runtime's reference GPT keeps them there too). The what-if's Oobleck-style model splits the same
way (whatif/strategies/pipeline.py layer_units). Parameters from the model shape, 12*h^2 per layer
over the tensor-parallel degree, bf16 parameters + bf16 gradients (4 bytes per parameter) resident
as `param_mib`, fp32 Adam moments + fp32 master copy (12 bytes per parameter) as
`optimizer_state_mib` (0 when the shape is unknown).

Given or derived, a stage's `extras` are its figure minus the sum of its layers' under the job's
own partition (for a measured profile, runtime_adapter/profile_layers.py: the embedding / head).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.contract import JobSpec, LayerProfile
from planner.errors import InvalidInputError

MIB = 1024 * 1024
LAYER_FIELDS = ("forward", "backward_input", "backward_weight", "activation_mib", "weight_grad_mib")
PARAM_BYTES, OPTIMIZER_BYTES = 4, 12  # bf16 param + grad; fp32 m, v and master copy
ASSUMED_MIB_PER_MS = 10.0  # ~10 GB/s when neither comm.migration_mib_per_ms nor the model shape is known


def default_partition(num_layers: int, num_stages: int) -> list[list[int]]:
    """The runtime's split (runtime_adapter/model.py stage_layers, copied: the planner must not import
    the runtime): contiguous ranges whose sizes differ by at most one, the larger ones first."""
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append([start, start + n])
        start += n
    return out


def lightest_split(
    stages: Sequence[Mapping[str, float]], counts: Sequence[int]
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(one layer's figures, each stage's extras) of stages holding `counts` equal layers: per field,
    the least figure per layer over the stages holding any, and a stage's extra is its figure minus
    its layers' (>= 0; all of it for a stage holding none). ValueError when no stage holds a layer."""
    held = [(st, n) for st, n in zip(stages, counts, strict=True) if n > 0]
    if not held:
        raise ValueError("no stage holds a layer")
    layer = {f: min(float(st[f]) / n for st, n in held) for f in stages[0]}
    extras = [{f: float(st[f]) - n * layer[f] for f in layer} for st, n in zip(stages, counts, strict=True)]
    return layer, extras


@dataclass(frozen=True)
class LayerModel:
    """A job's layers, the partition it runs with, what each stage has beyond its layers, and where
    the figures came from ("given" or "derived")."""

    layers: list[LayerProfile]
    partition: list[list[int]]
    extras: list[dict[str, float]]  # per stage: stage figure - sum of its layers' figure (job's partition)
    source: str
    migration_mib_per_ms: float
    bandwidth_source: str  # "given", "derived" or "assumed"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def resident_mib(self, a: int, b: int) -> float:
        """Parameters + optimizer state of layers [a, b)."""
        return sum(x.param_mib + x.optimizer_state_mib for x in self.layers[a:b])

    def moved_mib(self, a: int, b: int) -> float:
        """What moving layers [a, b) sends: parameters (`param_mib` without its gradient half) and
        optimizer state."""
        return sum(x.param_mib / 2 + x.optimizer_state_mib for x in self.layers[a:b])


def _model(job: JobSpec) -> dict[str, object]:
    model = (job.__pydantic_extra__ or {}).get("model")
    return model if isinstance(model, dict) else {}


def _int(model: dict[str, object], key: str, default: int) -> int:
    v = model.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def _bandwidth(job: JobSpec) -> tuple[float, str]:
    """comm.migration_mib_per_ms, else one stage-boundary activation (seq * micro_batch * hidden
    bf16 values over the tensor-parallel degree) over comm.activation_ms, else ASSUMED_MIB_PER_MS."""
    given = (job.comm.__pydantic_extra__ or {}).get("migration_mib_per_ms")
    if given is not None:
        return float(given), "given"
    model = _model(job)
    hidden = _int(model, "hidden", 0)
    if hidden and job.comm.activation_ms > 0:
        tp = _int(model, "tensor_parallel", 1)
        mib = _int(model, "seq_len", 2048) * _int(model, "micro_batch", 1) * hidden * 2 / tp / MIB
        return mib / job.comm.activation_ms, "derived"
    return ASSUMED_MIB_PER_MS, "assumed"


def _derived_layers(job: JobSpec, partition: list[list[int]]) -> list[LayerProfile]:
    model = _model(job)
    hidden, tp = _int(model, "hidden", 0), _int(model, "tensor_parallel", 1)
    params = 12 * hidden * hidden / tp
    figures = [{f: float(getattr(p, f)) for f in LAYER_FIELDS} for p in job.stages]
    fig, _ = lightest_split(figures, [b - a for a, b in partition])
    layer = LayerProfile(
        **fig, param_mib=params * PARAM_BYTES / MIB, optimizer_state_mib=params * OPTIMIZER_BYTES / MIB
    )
    return [layer] * sum(b - a for a, b in partition)


def layer_model(job: JobSpec) -> LayerModel:
    """The job's per-layer figures; InvalidInputError when it has neither `layers` nor `model.layers`."""
    n = job.num_layers()
    if n is None:
        raise InvalidInputError(
            "layers: re-partition needs per-layer figures: give `layers`, or `model.layers` >= num_stages"
        )
    partition = job.partition_ranges() or default_partition(n, job.num_stages)
    given = job.layer_profiles()
    layers = given if given is not None else _derived_layers(job, partition)
    extras = []
    for s, (a, b) in enumerate(partition):
        prof = job.stages[s]
        extras.append(
            {f: float(getattr(prof, f)) - sum(getattr(x, f) for x in layers[a:b]) for f in LAYER_FIELDS}
        )
    bw, bw_source = _bandwidth(job)
    return LayerModel(layers, partition, extras, "given" if given is not None else "derived", bw, bw_source)
