"""Per-layer profile (issue 12): the figures a job spec's optional `layers` field holds.

A Training whose stages can hold any contiguous layer range (`Training.layer_ranges`) is profiled
as a pipeline of one layer per stage, with runtime_adapter.profile's own measurement (the same ops
the executor runs), between two stages of no layer: the first stage's non-layer parts alone (the
embeddings) and the last stage's (the head and loss). So `layers` are the blocks only, and the
first and last stage's extras (docs/contract.md 1b: a stage's figure minus its layers') are the
embedding and head, which stay on those stages under every partition, also one that leaves them
no layer, as the runtime keeps them there. An end whose empty stage has no trainable parameter (a
model that is a plain list of layers) is not measured (it would be the identity): no extra.
`param_mib` is the layer's parameters and their gradients (their dtype's size each),
`optimizer_state_mib` the state the Training's own optimizer keeps after one step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime_adapter.profile import MIB, StageMeasurement, profile_stages
from runtime_adapter.training import LayerRanges, Training, build_optimizer, build_stage_module

SCALED = ("forward", "backward_input", "backward_weight", "activation_mib", "weight_grad_mib")


@dataclass(frozen=True)
class MeasuredLayers:
    """One `layers` entry per layer (the blocks alone), and the first / last stage's non-layer parts
    (the SCALED fields; zero when the model has none). `len()` is the layer count."""

    layers: list[dict[str, float]]
    first: dict[str, float]
    last: dict[str, float]

    def __len__(self) -> int:
        return len(self.layers)


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _layer_pipeline(training: Training) -> tuple[Training, int, int]:
    """(a Training whose stage s of its own P is the s-th of [first end?] + one layer each + [last
    end?], whether it has the first end, whether the last), the ends only when they have parameters."""
    ranges = training.layer_ranges
    assert ranges is not None
    n = ranges.num_layers
    first = int(_trainable(ranges.build(0, n + 2, range(0, 0))))
    last = int(_trainable(ranges.build(n + 1, n + 2, range(n, n))))
    held = [range(0, 0)] * first + [range(j, j + 1) for j in range(n)] + [range(n, n)] * last

    def stage(s: int, num_stages: int) -> nn.Module:
        return ranges.build(s, num_stages, held[s])

    layered = LayerRanges(len(held), lambda s, p, _layers: stage(s, p), ranges.prefix)
    return dataclasses.replace(training, stage=stage, layer_ranges=layered), first, last


def _resident_mib(training: Training, stage: int, num_stages: int) -> tuple[float, float]:
    """(parameters + gradients, optimizer state) of stage `stage` of `num_stages` (one layer)."""
    module = build_stage_module(training, stage, num_stages)
    params = [p for p in module.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = build_optimizer(training, params)  # a parameter-free layer (ReLU) gets NoParameters
    opt.step()
    state = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return 2 * param_bytes / MIB, state / MIB


def _figures(m: StageMeasurement) -> dict[str, float]:
    return {
        "forward": m.forward_ms,
        "backward_input": m.backward_input_ms,
        "backward_weight": m.backward_weight_ms,
        "activation_mib": m.activation_mib,
        "weight_grad_mib": m.weight_grad_mib,
    }


def profile_layers(
    training: Training, num_pipelines: int = 1, num_microbatches: int = 1, **options: Any
) -> MeasuredLayers:
    """Every layer of `training` and its first / last stage's non-layer parts, measured (see the
    module doc); `options` are profile_stages's (repeats, warmup, threads, progress, device).
    ValueError when the Training cannot build stages from layer ranges."""
    if training.layer_ranges is None:
        raise ValueError("per-layer profile: the Training has no layer_ranges (stages from layer ranges)")
    n = training.layer_ranges.num_layers
    piped, first, last = _layer_pipeline(training)
    p = n + first + last
    stages = profile_stages(piped, p, num_pipelines, num_microbatches, **options)
    zero = dict.fromkeys(SCALED, 0.0)
    layers = []
    for m in stages[first : first + n]:
        param_mib, state_mib = _resident_mib(piped, m.stage, p)
        layers.append({**_figures(m), "param_mib": param_mib, "optimizer_state_mib": state_mib})
    return MeasuredLayers(
        layers, _figures(stages[0]) if first else zero, _figures(stages[-1]) if last else zero
    )


def with_layers(job_doc: dict[str, Any], training: Training, measured: MeasuredLayers) -> dict[str, Any]:
    """`job_doc` (a job spec as JSON) with `layers` and the runtime's `partition` added.

    The layers and ends were measured apart, the stages as a whole: separate timings of the same
    work, which differ (fused kernels, per-op overhead, a loaded machine). The parts are taken as
    the split and the stage figures as the totals: each stage's layers and ends are scaled by one
    factor per field so they sum to its stage figure (parameter and optimizer bytes are exact
    already). So a middle stage has no extra, the first and last stage's extras (stage figure minus
    its layers', as the planner computes them) are their scaled embedding and head, none is
    negative, and moving a layer moves exactly its share of the measured stage."""
    ranges = training.layer_ranges
    assert ranges is not None
    home = ranges.home(int(job_doc["num_stages"]))
    layers = measured.layers
    scaled = [dict(x) for x in layers]
    for s, (stage, r) in enumerate(zip(job_doc["stages"], home, strict=True)):
        for f in SCALED:
            ends = (measured.first[f] if s == 0 else 0.0) + (measured.last[f] if s == len(home) - 1 else 0.0)
            total = sum(layers[i][f] for i in r) + ends
            for i in r:
                scaled[i][f] = stage[f] * layers[i][f] / total if total > 0 else stage[f] / len(r)
    return {**job_doc, "layers": scaled, "partition": [[r.start, r.stop] for r in home]}
