"""Per-layer profile (issue 12): the figures a job spec's optional `layers` field holds.

A Training whose stages can hold any contiguous layer range (`Training.layer_ranges`) is profiled
as a pipeline of one layer per stage, with runtime_adapter.profile's own measurement (the same ops
the executor runs). Layer 0 carries stage 0's non-layer parts (embeddings) and the last layer the
head and loss: those layers never leave the first / last stage, so it is the same as keeping them
as stage extras. `param_mib` is the layer's parameters and their gradients (their dtype's size
each), `optimizer_state_mib` the state the Training's own optimizer keeps after one step.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime_adapter.profile import MIB, StageMeasurement, profile_stages
from runtime_adapter.training import Training, build_stage_module


def _resident_mib(training: Training, layer: int, num_layers: int) -> tuple[float, float]:
    """(parameters + gradients, optimizer state) of one layer built as stage `layer` of `num_layers`."""
    module = build_stage_module(training, layer, num_layers)
    params = [p for p in module.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = training.optimizer(params)
    opt.step()
    state = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return 2 * param_bytes / MIB, state / MIB


def profile_layers(
    training: Training, num_pipelines: int = 1, num_microbatches: int = 1, **options: Any
) -> list[dict[str, float]]:
    """One `layers` entry (docs/contract.md 1b) per layer of `training`; `options` are
    profile_stages's (repeats, warmup, threads, progress, device). ValueError when the Training
    cannot build stages from layer ranges."""
    ranges = training.layer_ranges
    if ranges is None:
        raise ValueError("per-layer profile: the Training has no layer_ranges (stages from layer ranges)")
    n = ranges.num_layers
    stages: list[StageMeasurement] = profile_stages(training, n, num_pipelines, num_microbatches, **options)
    out = []
    for m in stages:
        param_mib, state_mib = _resident_mib(training, m.stage, n)
        out.append(
            {
                "forward": m.forward_ms,
                "backward_input": m.backward_input_ms,
                "backward_weight": m.backward_weight_ms,
                "activation_mib": m.activation_mib,
                "weight_grad_mib": m.weight_grad_mib,
                "param_mib": param_mib,
                "optimizer_state_mib": state_mib,
            }
        )
    return out


SCALED = ("forward", "backward_input", "backward_weight", "activation_mib", "weight_grad_mib")


def with_layers(
    job_doc: dict[str, Any], training: Training, layers: list[dict[str, float]]
) -> dict[str, Any]:
    """`job_doc` (a job spec as JSON) with `layers` and the runtime's `partition` added.

    The layers were measured one per stage, the stages as a whole: separate timings of the same
    work, which differ (fused kernels, per-op overhead, a loaded machine). The per-layer figures are
    taken as the split and the stage figures as the totals: each stage's layers are scaled so their
    sum equals its stage figure (time and activation fields; parameter and optimizer bytes are exact
    already), so the stage extras (docs/contract.md 1b) are zero and moving a layer moves exactly
    its share of the measured stage."""
    ranges = training.layer_ranges
    assert ranges is not None
    home = ranges.home(int(job_doc["num_stages"]))
    scaled = [dict(x) for x in layers]
    for stage, r in zip(job_doc["stages"], home, strict=True):
        for f in SCALED:
            total = sum(layers[i][f] for i in r)
            for i in r:
                scaled[i][f] = stage[f] * layers[i][f] / total if total > 0 else stage[f] / len(r)
    return {**job_doc, "layers": scaled, "partition": [[r.start, r.stop] for r in home]}
