"""A Hugging Face GPT-2 trained under recycle: `training(**kwargs)` returns its `Training`.

The model is `transformers.GPT2LMHeadModel`, randomly initialised from a `GPT2Config` (nothing is
downloaded), on byte-level tokens (vocab 256) of the public-domain text shipped in
`examples/data/public_domain.txt`. Its layers, in order, are

    0             the embedding: wte + wpe + dropout        (token ids -> hidden states)
    1 .. n_layer  the GPT2Blocks, one tensor in and out     (hidden -> hidden)
    n_layer + 1   the head: ln_f + lm_head                  (hidden -> logits over 256 bytes)

and stage s of P holds a contiguous slice of them (`split`: the layer index at which each stage after
the first starts; None: as even as possible). The head is untied from the embedding
(`tie_word_embeddings=False`): the two live on different stages. Each micro-batch is
`microbatch_size` windows of `seq_len + 1` bytes at offsets drawn from (seed, iteration, pipeline,
micro-batch) alone; the loss is the mean cross-entropy of the next byte.

Run it (from the repository root, which makes `examples` importable):

    recycle launch --job JOB --schedules DIR --entry examples.hf_gpt2:training \\
        --model '{"n_layer": 4, "n_embd": 64, "clip": 1.0}' --out out/hf

Keyword arguments (`--model` JSON) and their defaults: see `training`. Bad ones are a ValueError
naming the argument; a `split` that does not fit the job's P stages is a ValueError when the stage
is built.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional
from transformers import GPT2Config, GPT2LMHeadModel

from runtime_adapter.training import GradClip, Training, split_bounds, stages_from_layers

VOCAB_SIZE = 256  # bytes
DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


class Embedding(nn.Module):
    """Layer 0: token ids (B, T) -> hidden states (B, T, n_embd), as GPT2Model computes them."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


class Block(nn.Module):
    """One GPT2Block with causal self-attention, taking and returning one tensor.

    Outside GPT2Model nobody builds the causal mask: with "sdpa" GPT2Attention is causal without one
    (it passes is_causal=True to scaled_dot_product_attention, as GPT2Model itself relies on), but
    with "eager" and no mask every position attends to the future. So "eager" gets the additive mask
    GPT2Model would build, made on the input's device (meta too) at every call: no buffer to move.
    """

    def __init__(self, block: nn.Module, attn_implementation: str) -> None:
        super().__init__()
        self.block = block
        self.attn_implementation = attn_implementation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = None
        if self.attn_implementation != "sdpa":
            t = x.shape[-2]
            mask = torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)
        out = self.block(x, attention_mask=mask)
        # transformers 5 returns the hidden states; 4.x returned a tuple (hidden states, ...)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """The last layer: hidden states -> logits (B, T, 256)."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt2_config(
    n_layer: int, n_embd: int, n_head: int, seq_len: int, dropout: float, attn_implementation: str = "sdpa"
) -> GPT2Config:
    """The GPT2Config of the example (byte vocabulary, untied head, one dropout rate everywhere)."""
    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=seq_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=False,
        bos_token_id=None,  # GPT-2's 50256 is outside a byte vocabulary
        eos_token_id=None,
        attn_implementation=attn_implementation,  # type: ignore[call-arg]  # a PretrainedConfig kwarg
    )


def layers_of(model: GPT2LMHeadModel) -> list[nn.Module]:
    """The model's layers as the pipeline sees them (they share the model's parameters)."""
    t = model.transformer
    impl = model.config._attn_implementation
    return [Embedding(t.wte, t.wpe, t.drop), *(Block(b, impl) for b in t.h), Head(t.ln_f, model.lm_head)]


def load_bytes(path: str | Path) -> torch.Tensor:
    """The file's bytes, a uint8 tensor (the data function widens each window to int64 token ids)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"text {str(path)!r}: cannot read it ({e.strerror or e})") from e
    if not raw:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _stream_seed(*key: int) -> int:
    """A 63-bit seed from integers (blake2b: the same on every host and Python process)."""
    text = "hf_gpt2-data/" + "/".join(str(k) for k in key)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _whole(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, not {value}")
    return value


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {value!r}")
    return float(value)


def training(
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    seq_len: int = 32,
    microbatch_size: int = 4,
    dropout: float = 0.1,
    lr: float = 3e-3,
    weight_decay: float = 0.01,
    warmup: int = 5,
    clip: float | None = None,
    clip_scope: str = "stage",
    split: Sequence[int] | None = None,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    text: str | None = None,
) -> Training:
    """The Training of a GPT-2 on bytes of `text` (default: the shipped public-domain file).

    n_layer, n_embd, n_head: GPT2Blocks, hidden size, attention heads (n_embd % n_head == 0).
    seq_len, microbatch_size: each micro-batch is (microbatch_size, seq_len) bytes and their successors.
    dropout: embedding, attention and residual dropout (drawn from the executor-seeded global stream).
    lr, weight_decay: AdamW; weight decay applies to matrices (embeddings, projections), not to biases
                      or LayerNorm weights (two parameter groups per stage, as in GPT-2 recipes).
    warmup: iterations of linear learning-rate warm-up (lr_schedule), then constant; 0: none.
    clip, clip_scope: clip the gradient norm to `clip` per "stage" or over the "global" model; None: no.
    split: the layer index (1 .. n_layer + 1; 0 is the embedding, n_layer + 1 the head) at which each
           stage after the first starts; None: as even as possible. Must hold P - 1 indices.
    attn_implementation: "sdpa" (default) or "eager"; both causal and deterministic on CPU.
    seed: initial weights, dropout streams and the data offsets.
    """
    n_layer = _whole("n_layer", n_layer, 1)
    n_embd = _whole("n_embd", n_embd, 1)
    n_head = _whole("n_head", n_head, 1)
    seq_len = _whole("seq_len", seq_len, 1)
    microbatch_size = _whole("microbatch_size", microbatch_size, 1)
    warmup = _whole("warmup", warmup, 0)
    seed = _whole("seed", seed, 0)
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    dropout = _number("dropout", dropout)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), not {dropout}")
    lr = _number("lr", lr)
    if not lr > 0:
        raise ValueError(f"lr must be positive, not {lr}")
    weight_decay = _number("weight_decay", weight_decay)
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be at least 0, not {weight_decay}")
    if clip_scope not in ("stage", "global"):
        raise ValueError(f"clip_scope must be 'stage' or 'global', not {clip_scope!r}")
    grad_clip = None if clip is None else GradClip(_number("clip", clip), clip_scope)  # type: ignore[arg-type]
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, not {attn_implementation!r}"
        )

    num_layers = n_layer + 2
    if split is not None:
        if isinstance(split, str | bytes) or not isinstance(split, Sequence):
            raise ValueError(f"split must be a list of layer indices, not {split!r}")
        split = [_whole("split entry", b, 1) for b in split]
        if any(b >= c for b, c in itertools.pairwise(split)) or (split and split[-1] >= num_layers):
            raise ValueError(
                f"split {split}: expected increasing layer indices in 1..{num_layers - 1} "
                f"(layer 0 is the embedding, 1..{n_layer} the blocks, {num_layers - 1} the head)"
            )

    tokens = load_bytes(DEFAULT_TEXT if text is None else text)
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"text {str(text or DEFAULT_TEXT)!r} has {len(tokens)} bytes: seq_len + 1 are needed"
        )
    num_starts = len(tokens) - seq_len  # a window [start, start + seq_len] fits for start < num_starts
    steps = torch.arange(seq_len + 1, device="cpu")
    config = gpt2_config(n_layer, n_embd, n_head, seq_len, dropout, attn_implementation)

    def build_layers() -> list[nn.Module]:
        return layers_of(GPT2LMHeadModel(config))

    build = stages_from_layers(build_layers, split)

    def stage(s: int, num_stages: int) -> nn.Module:
        try:  # checked before building the model, with the layer count spelled out
            split_bounds(num_layers, num_stages, split)
        except ValueError as e:
            raise ValueError(
                f"{e}; the model has {num_layers} layers (embedding, {n_layer} GPT2Blocks, head): "
                "lower P, raise n_layer or fix split"
            ) from None
        if not 0 <= s < num_stages:
            raise ValueError(f"stage {s} is not one of the {num_stages} stages")
        return build(s, num_stages)

    def data(iteration: int, pipeline: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(_stream_seed(seed, iteration, pipeline, microbatch))
        starts = torch.randint(0, num_starts, (microbatch_size, 1), generator=gen, device="cpu")
        window = tokens[starts + steps].to(torch.int64)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return functional.cross_entropy(flat, targets.reshape(-1).to(flat.device))

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [
            {"params": group, "weight_decay": wd}
            for group, wd in ((decay, weight_decay), (no_decay, 0.0))
            if group
        ]
        return torch.optim.AdamW(groups, lr=lr)

    def lr_schedule(iteration: int) -> float:
        return min(1.0, (iteration + 1) / warmup)

    return Training(
        stage=stage,
        data=data,
        loss=loss,
        optimizer=optimizer,
        lr_schedule=lr_schedule if warmup > 0 else None,
        clip=grad_clip,
        seed=seed,
    )
