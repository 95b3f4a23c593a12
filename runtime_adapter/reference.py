"""Single-process training of the whole reference model: the ground truth the executor must match."""

from __future__ import annotations

import torch

from runtime_adapter.model import GPTConfig, SyntheticData, build_stages


def make_optimizer(params: list[torch.nn.Parameter], lr: float = 0.05) -> torch.optim.Optimizer:
    """The optimizer every stage uses (SGD with momentum: its update is a smooth function of the
    gradient, so summation-order noise stays at float rounding level)."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def train_reference(
    cfg: GPTConfig,
    num_pipelines: int,
    num_stages: int,
    num_microbatches: int,
    num_iterations: int,
    losses: list[float] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Train the whole model on the global batches for `num_iterations`; the stages' state dicts.

    The loss of each micro-batch is scaled by 1/(D*M), as the executor does, so one step here equals
    one iteration of the pipelined run whatever its schedule. `losses`, if given, gets each
    iteration's global loss (the mean of the unscaled micro-batch losses, before its step).
    """
    stages = build_stages(cfg, num_stages)
    optimizers = [make_optimizer(list(st.parameters())) for st in stages]
    data = SyntheticData(cfg)
    scale = 1.0 / (num_pipelines * num_microbatches)
    for it in range(num_iterations):
        total = 0.0
        for d in range(num_pipelines):
            for m in range(num_microbatches):
                tokens, targets = data.microbatch(it, d, m)
                x = tokens
                for st in stages[:-1]:
                    x = st(x)
                loss = stages[-1](x, targets)
                total += float(loss.detach())
                (loss * scale).backward()
        if losses is not None:
            losses.append(total * scale)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return [st.state_dict() for st in stages]


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor ||a - b|| / ||b|| over the tensors of two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"state dicts differ in keys: {sorted(a.keys() ^ b.keys())}")
    worst = 0.0
    for k in a:
        denom = float(b[k].float().norm()) or 1.0
        worst = max(worst, float((a[k].float() - b[k].float()).norm()) / denom)
    return worst
