"""The public API: train your own model under recycle.

A user describes the training once, as a `Training`, and names a function that returns it with an
entry point (`recycle launch --entry package.module:function`, keyword arguments from `--model` JSON).
Every worker calls that function, builds its own stage with `stage(s, P)` and runs the schedule's
micro-batches; re-routed micro-batches run on other pipelines' workers of the same stage.

What recycle relies on (the update equals the failure-free run's only if these hold):

- `data(iteration, pipeline, microbatch)` is a pure function of its three arguments: a micro-batch
  re-routed after a failure, or replayed after a rollback, is read again on another worker and must be
  the same tensors (`check_data=True` reads every micro-batch twice and compares);
- `stage(s, P)` builds the same module with the same initial weights on every worker of stage s (it
  runs after `torch.manual_seed(seed)`; `stages_from_layers` builds the whole layer list and slices it);
- random ops (dropout) draw from the global generator, which the executor seeds before every forward
  from (seed, iteration, pipeline, microbatch, stage): a micro-batch gets the same numbers wherever
  it runs (`microbatch_seed`);
- `lr_schedule(iteration)` multiplies each parameter group's initial learning rate: a pure function,
  so a rollback needs no scheduler state.

The last stage's output goes to `loss(output, targets)` (a scalar mean over the micro-batch); the
executor scales it by 1/(D*M), so one step is the gradient of the mean over the global batch.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

StageBuilder = Callable[[int, int], nn.Module]
DataFn = Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LrSchedule = Callable[[int], float]


class StageTypeError(TypeError):
    """A stage builder returned something that is not an nn.Module."""


@dataclass(frozen=True)
class GradClip:
    """Clip the gradient by its norm before each step.

    scope "stage": each stage clips its own gradient (no communication; the stagger is untouched).
    scope "global": the norm over every stage's gradient, as `torch.nn.utils.clip_grad_norm_` over the
    whole model: each worker exchanges its stage's squared norm with all alive workers before it steps,
    which waits for the slowest stage (a barrier the staggered optimizer otherwise avoids).
    """

    max_norm: float
    scope: Literal["stage", "global"] = "stage"

    def __post_init__(self) -> None:
        if not self.max_norm > 0:
            raise ValueError(f"GradClip.max_norm must be positive, not {self.max_norm}")
        if self.scope not in ("stage", "global"):
            raise ValueError(f"GradClip.scope must be 'stage' or 'global', not {self.scope!r}")


@dataclass(frozen=True)
class LayerRanges:
    """A model whose stages are contiguous ranges of `num_layers` layers: what re-partitioning needs
    (docs/runtime.md, "Layer migration"). `build(s, P, layers)` returns stage s of P holding exactly
    the layers in `layers` (plus stage s's non-layer parts: embeddings on stage 0, head on the last);
    the parameters of its j-th layer are named `<prefix><j>.*`. The default split is `split_bounds`.
    `layers` may be empty (a re-partition can leave a stage no layer): the stage is then its non-layer
    parts alone, or the identity for a middle stage (it passes activations and gradients through)."""

    num_layers: int
    build: Callable[[int, int, range], nn.Module]
    prefix: str = ""

    def home(self, num_stages: int) -> list[range]:
        """The layer range of every stage when nothing moved (the split `stage(s, P)` builds)."""
        b = split_bounds(self.num_layers, num_stages)
        return [range(b[s], b[s + 1]) for s in range(num_stages)]


@dataclass(frozen=True)
class Training:
    """What to train and how. Only `stage`, `data`, `loss` and `optimizer` are required.

    stage:            (s, P) -> the nn.Module of stage s of P. Stage 0 gets `inputs`, every other stage
                      the previous stage's output (one tensor); the last stage's output goes to `loss`.
    data:             (iteration, pipeline, microbatch) -> (inputs, targets), CPU or device tensors.
    loss:             (last stage output, targets) -> scalar loss, the mean over the micro-batch.
    optimizer:        parameters -> any torch.optim optimizer (its state is rolled back, broadcast to
                      re-joiners and checkpointed with the parameters).
    lr_schedule:      iteration -> multiplier of the initial learning rates (None: constant).
    clip:             gradient clipping by norm (None: none).
    seed:             initial weights and the per-micro-batch random streams.
    autocast:         e.g. torch.bfloat16: run forward under torch.autocast on the worker's device.
    boundary_dtype:   dtype of the activations and gradients sent between stages.
    activation_shape: shape of every stage's output (None: inferred on the meta device).
    check_data:       read every micro-batch twice and fail if the two reads differ.
    exact_sums:       sum the micro-batches' gradients in float64 (grad_sum.py), so a re-routed run's
                      update is the failure-free one to the bit (Adam needs it); False: float32, faster.
    layer_ranges:     how to build a stage from any contiguous layer range (`LayerRanges`); needed only
                      to run schedules that move layers between stages (a `partition`). None: refused.
    """

    stage: StageBuilder
    data: DataFn
    loss: LossFn
    optimizer: OptimizerFactory
    lr_schedule: LrSchedule | None = None
    clip: GradClip | None = None
    seed: int = 0
    autocast: torch.dtype | None = None
    boundary_dtype: torch.dtype = torch.float32
    activation_shape: tuple[int, ...] | None = None
    check_data: bool = False
    exact_sums: bool = True
    layer_ranges: LayerRanges | None = None


class NoParameters(torch.optim.Optimizer):
    """The optimizer of a stage without trainable parameters (an empty stage of a re-partition: no
    layer, no embedding or head), since torch optimizers refuse an empty parameter list: one empty
    group (lr 0), no state; `step` does nothing. Its state dict rolls back, moves to a re-joiner and
    checkpoints like any other."""

    def __init__(self) -> None:
        super().__init__([{"params": []}], {"lr": 0.0})

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        return None if closure is None else closure()


def build_optimizer(training: Training, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """`training.optimizer(params)`, or `NoParameters` for a stage without trainable parameters."""
    return training.optimizer(list(params)) if params else NoParameters()


def build_stage_module(training: Training, stage: int, num_stages: int) -> nn.Module:
    """Stage `stage` of `num_stages`, built after seeding the global generator with `training.seed`."""
    torch.manual_seed(training.seed)
    module = training.stage(stage, num_stages)
    if not isinstance(module, nn.Module):
        raise StageTypeError(
            f"stage({stage}, {num_stages}) returned {type(module).__name__}, not an nn.Module"
        )
    return module


def stages_from_layers(
    build_layers: Callable[[], Sequence[nn.Module]], split: Sequence[int] | None = None
) -> StageBuilder:
    """A stage builder from a whole model given as a list of layers (each takes one tensor).

    `split` lists the layer index at which each stage after the first starts (P - 1 increasing
    indices); None splits the layers as evenly as possible. Every worker builds the whole list (so
    every stage's weights are those of one model built from the seed) and keeps its slice.
    """

    def stage(s: int, num_stages: int) -> nn.Module:
        layers = list(build_layers())
        bounds = split_bounds(len(layers), num_stages, split)
        _refuse_tied(layers, bounds, s)
        return nn.Sequential(*layers[bounds[s] : bounds[s + 1]])

    return stage


def _refuse_tied(layers: Sequence[nn.Module], bounds: list[int], s: int) -> None:
    """ValueError when a layer of stage `s` shares a parameter with a layer of another stage (weights
    tied across stages, e.g. an embedding and the output head): each stage would step its own copy."""
    own = range(bounds[s], bounds[s + 1])
    mine = {id(p): j for j in own for p in layers[j].parameters()}
    for j, layer in enumerate(layers):
        if j in own:
            continue
        for p in layer.parameters():
            if id(p) in mine:
                raise ValueError(
                    f"layers {mine[id(p)]} and {j} share a parameter but fall on different stages (tied "
                    "weights): each stage would train its own copy; untie them"
                )


def layer_ranges_from_layers(build_layers: Callable[[], Sequence[nn.Module]]) -> LayerRanges:
    """`LayerRanges` for a model given as a list of layers (the even split of `stages_from_layers`
    without `split`): stage s holding `layers` is `nn.Sequential` of those layers (no layer: the
    identity, an empty `nn.Sequential`)."""

    def build(s: int, num_stages: int, layers: range) -> nn.Module:
        return nn.Sequential(*list(build_layers())[layers.start : layers.stop])

    return LayerRanges(len(build_layers()), build)


def split_bounds(num_layers: int, num_stages: int, split: Sequence[int] | None = None) -> list[int]:
    """Stage s holds layers [bounds[s], bounds[s + 1]); ValueError if they cannot fill every stage."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"{num_layers} layer(s) cannot be split into {num_stages} stages (one or more each)")
    if split is None:
        base, extra = divmod(num_layers, num_stages)
        bounds = [0]
        for s in range(num_stages):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
        return bounds
    bounds = [0, *split, num_layers]
    if len(split) != num_stages - 1 or any(b >= c for b, c in itertools.pairwise(bounds)):
        raise ValueError(
            f"split {list(split)}: expected {num_stages - 1} increasing layer indices in 1..{num_layers - 1}"
        )
    return bounds


def microbatch_seed(seed: int, iteration: int, pipeline: int, microbatch: int, stage: int) -> int:
    """The seed of the random stream of one micro-batch's forward on one stage (same on every host)."""
    key = f"{seed}/{iteration}/{pipeline}/{microbatch}/{stage}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def squared_norm(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """Sum of the squared gradient entries of `params` (float64 scalar; 0 without gradients)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            total = total + p.grad.detach().double().pow(2).sum().cpu()
    return total


def clip_by_norm(params: Sequence[nn.Parameter], total_squared: torch.Tensor, max_norm: float) -> float:
    """Scale the gradients of `params` so that a total norm sqrt(total_squared) becomes at most
    `max_norm` (as clip_grad_norm_ does: coefficient max_norm / (norm + 1e-6), capped at 1); the norm."""
    norm = float(total_squared.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def ordered_sum(stage_squared: torch.Tensor) -> torch.Tensor:
    """The global squared norm from the P stages' squared norms, summed in stage order (float64)."""
    total = torch.zeros((), dtype=torch.float64)
    for v in stage_squared.detach().double().cpu():
        total = total + v
    return total


def clip_gradients(
    params: Sequence[nn.Parameter],
    clip: GradClip | None,
    stage: int,
    num_stages: int,
    exchange: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float | None:
    """Clip stage `stage`'s gradients as `clip` says; the norm it clipped by (None without `clip`).

    With scope "global", `exchange` gets a vector of P squared norms holding this stage's at its index
    and zeros elsewhere, and must return the element-wise maximum over every alive worker (the peers
    of a stage hold equal values), so the sum is the same whichever workers are alive."""
    if clip is None:
        return None
    squared = squared_norm(params)
    if clip.scope == "global":
        if exchange is None:
            raise ValueError("global-norm clipping needs the other stages' norms")
        norms = torch.zeros(num_stages, dtype=torch.float64)
        norms[stage] = squared
        squared = ordered_sum(exchange(norms))
    return clip_by_norm(params, squared, clip.max_norm)


def apply_lr(
    optimizer: torch.optim.Optimizer, base_lrs: Sequence[float], schedule: LrSchedule | None, iteration: int
) -> None:
    """Set each parameter group's learning rate for `iteration` (no-op without a schedule)."""
    if schedule is None:
        return
    factor = float(schedule(iteration))
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * factor
