"""Order-free gradient sums: each micro-batch's parameter gradients are added into float64 buffers.

A re-routed schedule sums the same micro-batch gradients as the failure-free run, but grouped and
ordered differently (a survivor accumulates its own and a dead peer's micro-batches, then the stage
all-reduce adds fewer partial sums). In float32 that changes the rounding, and an optimizer that
normalizes the update (Adam's m / sqrt(v)) turns that noise into visible parameter differences. The
float64 sum of float32 values, all-reduced in float64 and rounded to float32 once, is the same whatever
the grouping (up to float64 rounding, far below float32's): the failure-free gradient, to the bit in
practice. Cost: a float64 copy of the stage's parameters, a float64 add per parameter and micro-batch
(memory-bound: it matters when micro-batches are small next to the parameters) and a float64
all-reduce. `Training.exact_sums=False` turns it off: gradients then accumulate in float32 in `.grad`
(autograd's own accumulation) and the all-reduce is float32, as before; fine for SGD, where the
rounding noise stays at float32 level, not for Adam.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class GradSum:
    """The float64 sum of the gradients of `params` over the micro-batches added so far."""

    def __init__(self, params: Sequence[nn.Parameter], exact: bool = True) -> None:
        self.params, self.exact = list(params), exact
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)
        self.dtype = torch.float64 if exact else torch.float32  # of flat() and the all-reduce

    def add(self) -> None:
        """Move the parameters' current gradients (one micro-batch's) into the sums (exact: else they
        stay in `.grad`, where autograd accumulates them)."""
        if not self.exact:
            return
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            s = self.sums[i]
            if s is None:
                self.sums[i] = p.grad.detach().to(torch.float64)
            else:
                s.add_(p.grad.detach())  # float32 into float64 in place: no temporary
            p.grad = None

    def flat(self, device: torch.device) -> torch.Tensor:
        """All sums, flattened in parameter order (zeros where a parameter got no gradient)."""
        sums = self.sums if self.exact else [p.grad for p in self.params]
        parts = [
            (
                s.to(self.dtype) if s is not None else torch.zeros(p.shape, dtype=self.dtype, device=p.device)
            ).reshape(-1)
            for s, p in zip(sums, self.params, strict=True)
        ]
        if not parts:  # a stage without trainable parameters
            return torch.zeros(0, dtype=self.dtype, device=device)
        return torch.cat([t.to(device) for t in parts])

    def set_grads(self, flat: torch.Tensor) -> None:
        """Set each parameter's gradient from a flat float64 vector laid out as `flat()`."""
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view(p.shape).to(p.device, p.dtype)
            offset += n

    def clear(self) -> None:
        self.sums = [None] * len(self.params)
