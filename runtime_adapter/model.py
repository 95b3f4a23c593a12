"""Reference model: a small GPT-style transformer split into P stage modules, and its synthetic data.

Stage 0 owns the token and position embeddings, the last stage owns the final norm and the head (its
output is the logits; the loss is `cross_entropy`); the transformer blocks are split as evenly as
possible. The data source is a pure function of (seed, iteration, micro-batch [d, m]), so a run with
failures and a run without see the same global batches whichever host runs a micro-batch.

`training(**fields)` is the default entry point (runtime_adapter/entry.py): the reference GPT is one
user of the public API (runtime_adapter/training.py) like any other model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional

from runtime_adapter.training import GradClip, LayerRanges, Training


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the reference GPT (tiny by default: tests run it on CPU)."""

    vocab_size: int = 64
    seq_len: int = 16
    hidden: int = 32
    num_heads: int = 2
    num_layers: int = 4
    microbatch_size: int = 2
    seed: int = 0
    dropout: float = 0.0  # attention and residual dropout (drawn from the per-micro-batch streams)

    def __post_init__(self) -> None:
        sizes = (
            self.vocab_size,
            self.seq_len,
            self.hidden,
            self.num_heads,
            self.num_layers,
            self.microbatch_size,
        )
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (*sizes, self.seed)):
            raise ValueError(f"every field must be a whole number: {self}")
        if min(sizes) < 1:
            raise ValueError(f"every size must be positive: {self}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of num_heads ({self.num_heads})")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, int | float)
            or not 0 <= self.dropout < 1
        ):
            raise ValueError(f"dropout must be a number in [0, 1), not {self.dropout!r}")


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = nn.MultiheadAttention(cfg.hidden, cfg.num_heads, dropout=cfg.dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.GELU(), nn.Linear(4 * cfg.hidden, cfg.hidden)
        )
        self.drop = nn.Dropout(cfg.dropout)
        mask = torch.triu(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=self.mask, need_weights=False)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.ln2(x)))


class StageModule(nn.Module):
    """One pipeline stage: `forward(inp)` returns the activation, or the logits on the last stage.
    `layers` may be empty (a re-partition that moves all of a stage's blocks to its neighbours): stage 0
    keeps its embeddings, the last stage its head, and a middle stage has no parameter and returns its
    input itself (the identity; the executor passes activations and gradients through it)."""

    def __init__(self, cfg: GPTConfig, stage: int, num_stages: int, layers: range) -> None:
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        if self.is_first:
            self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
            self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in layers)
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = inp
        if self.is_first:
            positions = torch.arange(inp.shape[1], device=inp.device)
            x = self.tok(inp) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        if not self.is_last:
            return x
        return self.head(self.ln_f(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (batch, seq, vocab) logits against (batch, seq) targets."""
    return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Split `num_layers` blocks into `num_stages` contiguous ranges, sizes differing by at most one
    (the same rule as training.split_bounds: `LayerRanges.home`). A schedule's `partition` moves
    blocks between stages: `StageModule(cfg, s, P, layers)` builds stage s with any range (the
    layer migration of migration.py; `gpt_training` gives the Training its `LayerRanges`)."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"need at least one block per stage: {num_layers} blocks for {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def build_stages(cfg: GPTConfig, num_stages: int) -> list[StageModule]:
    """All P stage modules, initialised from `cfg.seed` (every peer of a stage gets the same weights)."""
    torch.manual_seed(cfg.seed)
    return [
        StageModule(cfg, s, num_stages, r) for s, r in enumerate(stage_layers(cfg.num_layers, num_stages))
    ]


def build_stage(cfg: GPTConfig, num_stages: int, stage: int) -> StageModule:
    """Stage `stage` alone, with the same weights `build_stages` gives it."""
    return build_stages(cfg, num_stages)[stage]


class SyntheticData:
    """Deterministic token batches keyed by (iteration, d, m): a learnable shifted-sequence task."""

    def __init__(self, cfg: GPTConfig) -> None:
        self.cfg = cfg

    def microbatch(self, iteration: int, d: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets) of micro-batch [d, m] in `iteration`; both (microbatch_size, seq_len) int64."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(hash((cfg.seed, iteration, d, m)) & 0x7FFF_FFFF)
        start = torch.randint(0, cfg.vocab_size, (cfg.microbatch_size, 1), generator=gen)
        step = torch.randint(1, 4, (cfg.microbatch_size, 1), generator=gen)
        seq = (start + step * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def make_optimizer(params: list[torch.nn.Parameter], lr: float = 0.05) -> torch.optim.Optimizer:
    """The reference optimizer (SGD with momentum: its update is a smooth function of the gradient,
    so summation-order noise stays at float rounding level)."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def gpt_training(
    cfg: GPTConfig,
    optimizer: Literal["sgd", "adamw"] = "sgd",
    lr: float | None = None,
    clip: float | None = None,
    clip_scope: Literal["stage", "global"] = "stage",
    warmup: int = 0,
    exact_sums: bool = True,
) -> Training:
    """The reference GPT as a `Training`: SGD with momentum (lr 0.05) or AdamW (lr 1e-3), optional
    clipping by norm, a linear warm-up of `warmup` iterations, float64 gradient sums unless
    `exact_sums` is False."""
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', not {optimizer!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a whole number of iterations >= 0, not {warmup!r}")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < 1e6):
        raise ValueError(f"lr must be a positive finite number (below 1e6), not {lr!r}")
    if not isinstance(exact_sums, bool):
        raise ValueError(f"exact_sums must be true or false, not {exact_sums!r}")
    if clip_scope not in ("stage", "global"):
        raise ValueError(f"clip_scope must be 'stage' or 'global', not {clip_scope!r}")
    rate = lr if lr is not None else (0.05 if optimizer == "sgd" else 1e-3)

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if optimizer == "adamw":
            return torch.optim.AdamW(params, lr=rate, weight_decay=0.01)
        return make_optimizer(params, rate)

    data = SyntheticData(cfg)
    return Training(
        stage=lambda s, num_stages: build_stage(cfg, num_stages, s),
        data=data.microbatch,
        loss=cross_entropy,
        optimizer=make,
        lr_schedule=(lambda it: min(1.0, (it + 1) / warmup)) if warmup else None,
        clip=GradClip(clip, clip_scope) if clip is not None else None,
        seed=cfg.seed,
        activation_shape=(cfg.microbatch_size, cfg.seq_len, cfg.hidden),
        exact_sums=exact_sums,
        layer_ranges=LayerRanges(
            cfg.num_layers, lambda s, num_stages, layers: StageModule(cfg, s, num_stages, layers), "blocks."
        ),
    )


def training(**kwargs: Any) -> Training:
    """The default entry point: GPTConfig fields plus `gpt_training`'s options (optimizer, lr, clip,
    clip_scope, warmup, exact_sums) as keyword arguments."""
    names = ("optimizer", "lr", "clip", "clip_scope", "warmup", "exact_sums")
    options = {k: kwargs.pop(k) for k in names if k in kwargs}
    return gpt_training(GPTConfig(**kwargs), **options)
