"""Per-layer figures of a `Training` with layer ranges, for planning and checking a re-partition: the
job spec's optional `layers` (docs/contract.md, issue 12) with each layer's parameter and optimizer
state sizes measured on the model itself, and the op times and memory of a layer the planner's derived
rule's (planner.partition.layers.lightest_split: the lightest stage's figure per layer, the rest of a
stage, e.g. the embedding or the head, its extras, which stay on that stage).
Used by the migration tests and `python -m bench.migration` to get the plan's `migration` estimate for
the reference GPT."""

from __future__ import annotations

from planner.contract import JobSpec
from planner.partition.layers import lightest_split
from runtime_adapter.training import Training, build_stage_module

MIB = 2**20
FIELDS = ("forward", "backward_input", "backward_weight", "activation_mib", "weight_grad_mib")


def layer_mib(training: Training, num_stages: int, optimizer_copies: int) -> list[float]:
    """MiB of each layer's parameters (twice: the gradient buffer too) plus `optimizer_copies` copies
    of them (SGD with momentum: 1, Adam: 2), from the stage modules' `<prefix><j>.*` parameters."""
    ranges = training.layer_ranges
    if ranges is None:
        raise ValueError("the Training has no layer_ranges")
    out: list[float] = []
    for s, layers in enumerate(ranges.home(num_stages)):
        module = build_stage_module(training, s, num_stages)
        for j in range(len(layers)):
            sub = module.get_submodule(f"{ranges.prefix}{j}")
            nbytes = sum(p.numel() * p.element_size() for p in sub.parameters())
            out.append(nbytes * (2 + optimizer_copies) / MIB)
    return out


def with_derived_layers(
    job: JobSpec, training: Training, optimizer_copies: int, mib_per_ms: float
) -> JobSpec:
    """`job` plus `layers` (every layer the lightest stage's figures per layer, so each stage's excess
    stays its extras; the resident sizes measured) and `comm.migration_mib_per_ms`."""
    assert training.layer_ranges is not None
    sizes = layer_mib(training, job.num_stages, optimizer_copies)
    home = training.layer_ranges.home(job.num_stages)
    stages = [{f: float(getattr(job.stages[s], f)) for f in FIELDS} for s in range(job.num_stages)]
    fig, _ = lightest_split(stages, [len(r) for r in home])
    layers = []
    for r in home:
        for i in r:
            share = sizes[i] / (2 + optimizer_copies)  # one copy of the parameters
            layers.append({**fig, "param_mib": 2 * share, "optimizer_state_mib": optimizer_copies * share})
    data = job.model_dump(mode="json")
    data["layers"] = layers
    data["comm"]["migration_mib_per_ms"] = mib_per_ms
    return JobSpec.model_validate(data)
