"""Per-layer figures of a `Training` with layer ranges, for planning and checking a re-partition: the
job spec's optional `layers` (docs/contract.md, issue 12) with each layer's parameter and optimizer
state sizes measured on the model itself, and the op times of each stage split evenly over its layers.
Used by the migration tests and `python -m bench.migration` to get the plan's `migration` estimate for
the reference GPT."""

from __future__ import annotations

from planner.contract import JobSpec
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


def with_layers(job: JobSpec, training: Training, optimizer_copies: int, mib_per_ms: float) -> JobSpec:
    """`job` plus `layers` (each stage's op times and memory split evenly over its layers, the
    resident sizes measured) and `comm.migration_mib_per_ms`."""
    assert training.layer_ranges is not None
    sizes = layer_mib(training, job.num_stages, optimizer_copies)
    layers = []
    for s, r in enumerate(training.layer_ranges.home(job.num_stages)):
        prof = job.stages[s]
        for i in r:
            fig = {f: float(getattr(prof, f)) / len(r) for f in FIELDS}
            share = sizes[i] / (2 + optimizer_copies)  # one copy of the parameters
            layers.append({**fig, "param_mib": 2 * share, "optimizer_state_mib": optimizer_copies * share})
    data = job.model_dump(mode="json")
    data["layers"] = layers
    data["comm"]["migration_mib_per_ms"] = mib_per_ms
    return JobSpec.model_validate(data)
