"""Reference model: a small GPT-style transformer split into P stage modules, and its synthetic data.

Stage 0 owns the token and position embeddings, the last stage owns the final norm, the head and the
loss; the transformer blocks are split as evenly as possible. The data source is a pure function of
(seed, iteration, micro-batch [d, m]), so a run with failures and a run without see the same global
batches whichever host runs a micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional


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


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = nn.MultiheadAttention(cfg.hidden, cfg.num_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.GELU(), nn.Linear(4 * cfg.hidden, cfg.hidden)
        )
        mask = torch.triu(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=self.mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class StageModule(nn.Module):
    """One pipeline stage. `forward(inp, targets)` returns the activation, or the loss on the last stage."""

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

    def forward(self, inp: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = inp
        if self.is_first:
            positions = torch.arange(inp.shape[1], device=inp.device)
            x = self.tok(inp) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        if not self.is_last:
            return x
        assert targets is not None, "the last stage needs targets"
        logits = self.head(self.ln_f(x))
        return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Split `num_layers` blocks into `num_stages` contiguous ranges, sizes differing by at most one."""
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
