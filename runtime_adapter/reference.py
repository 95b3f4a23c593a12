"""Single-process training of the whole model: the ground truth the executor must match."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from runtime_adapter.grad_sum import GradSum
from runtime_adapter.migration_plan import to_global
from runtime_adapter.stage import StageRunner, infer_shapes
from runtime_adapter.training import Training, apply_lr, build_optimizer, clip_gradients, squared_norm


def train_reference(
    training: Training,
    num_pipelines: int,
    num_stages: int,
    num_microbatches: int,
    num_iterations: int,
    losses: list[float] | None = None,
    device: torch.device | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Train the whole model on the global batches for `num_iterations`; the stages' state dicts.

    Every micro-batch's forward runs through the executor's own `StageRunner.forward` (same random
    streams, autocast and boundary casts); its loss is scaled by 1/(D*M) and its gradients summed in
    float64 (grad_sum.py), as the executor does, so one step here equals one iteration of the
    pipelined run whatever its schedule. Clipping and the
    learning-rate schedule are applied as the executor applies them. `losses`, if given, gets each
    iteration's global loss (the mean of the unscaled micro-batch losses, before its step).
    """
    device = device or torch.device("cpu")
    shapes = infer_shapes(training, num_stages)
    runners = [StageRunner(training, s, num_stages, device, shapes) for s in range(num_stages)]
    stages = [r.build() for r in runners]
    params = [[p for p in st.parameters() if p.requires_grad] for st in stages]
    optimizers = [build_optimizer(training, ps) for ps in params]
    base_lrs = [[float(g["lr"]) for g in opt.param_groups] for opt in optimizers]
    sums = [GradSum(ps, training.exact_sums) for ps in params]
    scale = 1.0 / (num_pipelines * num_microbatches)
    for it in range(num_iterations):
        total = 0.0
        for d in range(num_pipelines):
            for m in range(num_microbatches):
                x: torch.Tensor | None = None
                for r, st in zip(runners, stages, strict=True):
                    inputs, targets = r.read(it, d, m)
                    x = r.forward(st, it, (d, m), inputs if r.is_first else x, targets)  # type: ignore[arg-type]
                assert x is not None
                total += float(x.detach())
                (x * scale).backward()
                for gs in sums:
                    gs.add()
        if losses is not None:
            losses.append(total * scale)
        for gs in sums:
            gs.set_grads(gs.flat(device))
            gs.clear()
        _clip(training, params)
        for opt, lrs in zip(optimizers, base_lrs, strict=True):
            apply_lr(opt, lrs, training.lr_schedule, it)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return [st.state_dict() for st in stages]


def _clip(training: Training, params: list[list[torch.nn.Parameter]]) -> None:
    """The executor's clipping (training.clip_gradients), every stage's squared norm at hand: the
    "exchange" answers the vector the world all-reduce would (taken before any stage clips)."""
    if training.clip is None:
        return
    squared = torch.stack([squared_norm(ps) for ps in params])
    for s, ps in enumerate(params):
        clip_gradients(ps, training.clip, s, len(params), lambda _: squared)


def model_wide(
    states: Sequence[Mapping[str, torch.Tensor]], ranges: Sequence[range], prefix: str
) -> dict[str, torch.Tensor]:
    """Stage state dicts (the s-th holding layers `ranges[s]`) as one state of the whole model, each
    layer's entries named by its model-wide index (`<prefix><layer>.*`, migration_plan.to_global): the
    parameters of a worker holding any layer range (after a re-partition; an empty one holds none)
    compare with `train_reference`'s layer by layer."""
    whole: dict[str, torch.Tensor] = {}
    for state, layers in zip(states, ranges, strict=True):
        whole.update({to_global(k, layers, prefix): v for k, v in state.items()})
    return whole


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor ||a - b|| / ||b|| over the tensors of two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"state dicts differ in keys: {sorted(a.keys() ^ b.keys())}")
    worst = 0.0
    for k in a:
        denom = float(b[k].float().norm()) or 1.0
        worst = max(worst, float((a[k].float() - b[k].float()).norm()) / denom)
    return worst
