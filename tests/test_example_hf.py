"""examples/hf_gpt2.py: a Hugging Face GPT-2 as a recycle `Training` (faithful split, pure data,
meta-device shapes, a loss that goes down, actionable errors)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2LMHeadModel

from examples.hf_gpt2 import DEFAULT_TEXT, gpt2_config, training
from planner.errors import InvalidInputError
from runtime_adapter.entry import load_entry
from runtime_adapter.training import (
    GradClip,
    apply_lr,
    build_stage_module,
    clip_by_norm,
    microbatch_seed,
    split_bounds,
    squared_norm,
)

SMALL: dict[str, Any] = {"n_layer": 4, "n_embd": 64, "n_head": 4, "seq_len": 32, "microbatch_size": 4}


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these matrices are tiny, and on a busy 2-core machine two threads spinning
    against other processes make the training loop ten times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_name(layer: int, n_layer: int, name: str) -> str:
    """The GPT2LMHeadModel parameter behind parameter `name` of pipeline layer `layer`."""
    if layer == 0:
        return f"transformer.{name}"  # wte.weight, wpe.weight
    if layer <= n_layer:
        return f"transformer.h.{layer - 1}.{name.removeprefix('block.')}"
    return name if name.startswith("lm_head.") else f"transformer.{name}"  # ln_f.*


def copy_hf_weights(hf: GPT2LMHeadModel, stages: list, n_layer: int) -> int:
    """Load the HF model's weights into the stage modules; the number of tensors copied."""
    hf_params = dict(hf.named_parameters())
    bounds = split_bounds(n_layer + 2, len(stages))
    copied = 0
    with torch.no_grad():
        for s, module in enumerate(stages):
            for local, layer in enumerate(module):
                for name, p in layer.named_parameters():
                    src = hf_params[hf_name(bounds[s] + local, n_layer, name)]
                    assert src.shape == p.shape, name
                    p.copy_(src)
                    copied += 1
    return copied


def run_stages(stages: list, x: torch.Tensor) -> torch.Tensor:
    for module in stages:
        x = module(x)
    return x


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_staged_model_is_the_hf_model(attn: str) -> None:
    """Stages loaded with a GPT2LMHeadModel's weights give its logits, and are causal."""
    tr = training(**SMALL, dropout=0.0, attn_implementation=attn)
    stages = [build_stage_module(tr, s, 3).eval() for s in range(3)]
    torch.manual_seed(1234)  # not the example's seed: the equality below comes from the copy
    hf = GPT2LMHeadModel(gpt2_config(4, 64, 4, 32, 0.0, attn)).eval()
    assert hf.config._attn_implementation == attn
    assert hf.lm_head.weight is not hf.transformer.wte.weight  # untied
    assert copy_hf_weights(hf, stages, 4) == len(list(hf.parameters()))
    x, _ = tr.data(0, 0, 0)
    with torch.no_grad():
        ours = run_stages(stages, x)
        theirs = hf(x).logits
        assert ours.shape == (4, 32, 256)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        # causal: changing the last token leaves the logits of every earlier position as they were
        x2 = x.clone()
        x2[:, -1] = (x2[:, -1] + 7) % 256
        ours2 = run_stages(stages, x2)
    torch.testing.assert_close(ours2[:, :-1], ours[:, :-1], rtol=0, atol=0)
    assert not torch.equal(ours2[:, -1], ours[:, -1])


def test_same_seed_same_weights_as_hf_model() -> None:
    """Every worker's stage s holds the slice of the GPT2LMHeadModel built from the seed."""
    tr = training(**SMALL, seed=5)
    stages = [build_stage_module(tr, s, 2) for s in range(2)]
    torch.manual_seed(5)
    hf = GPT2LMHeadModel(gpt2_config(4, 64, 4, 32, 0.1))
    ours = [p for m in stages for p in m.parameters()]
    assert len(ours) == len(list(hf.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(ours, hf.parameters(), strict=True))
    again = build_stage_module(tr, 1, 2)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), stages[1].parameters(), strict=True))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_dropout_follows_the_global_seed(attn: str) -> None:
    """A re-routed or replayed micro-batch draws the same dropout masks after the executor's seeding."""
    tr = training(**SMALL, dropout=0.3, attn_implementation=attn)
    module = build_stage_module(tr, 0, 1).train()
    x, _ = tr.data(0, 0, 0)
    outs = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        outs.append(module(x))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_data_is_pure_and_in_range() -> None:
    tr = training(**SMALL)
    x, y = tr.data(3, 1, 2)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert int(x.min()) >= 0 and int(x.max()) < 256
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets: the next byte
    x2, y2 = tr.data(3, 1, 2)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    rebuilt = training(**SMALL)  # another worker's Training: same micro-batch
    assert torch.equal(rebuilt.data(3, 1, 2)[0], x)
    for other in [(3, 1, 3), (3, 0, 2), (4, 1, 2)]:
        assert not torch.equal(tr.data(*other)[0], x), other
    assert not torch.equal(training(**SMALL, seed=1).data(3, 1, 2)[0], x)
    # the windows are the shipped text's bytes
    text = DEFAULT_TEXT.read_bytes()
    assert bytes(x[0].tolist()) + bytes(y[0, -1:].tolist()) in text


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 6])
def test_stages_infer_shapes_on_meta(attn: str, num_stages: int) -> None:
    """Built and run under torch.device("meta") (as the runtime infers activation shapes)."""
    tr = training(**SMALL, attn_implementation=attn)
    x, _ = tr.data(0, 0, 0)
    shapes = []
    with torch.device("meta"):
        h = torch.empty(x.shape, dtype=x.dtype)
        for s in range(num_stages):
            torch.manual_seed(tr.seed)
            module = tr.stage(s, num_stages).train()  # dropout on
            assert all(p.device.type == "meta" for p in module.parameters())
            h = module(h)
            assert h.device.type == "meta"
            shapes.append(tuple(h.shape))
    assert shapes[:-1] == [(4, 32, 64)] * (num_stages - 1)
    assert shapes[-1] == (4, 32, 256)


def train(tr, num_stages: int, microbatches: int, iterations: int) -> list[float]:
    """A failure-free single-process run of one pipeline, as the executor does it; the mean losses."""
    stages = [build_stage_module(tr, s, num_stages).train() for s in range(num_stages)]
    opts = [tr.optimizer(list(m.parameters())) for m in stages]
    assert all(isinstance(o, torch.optim.AdamW) for o in opts)
    base_lrs = [[g["lr"] for g in o.param_groups] for o in opts]
    losses = []
    for it in range(iterations):
        for opt, base in zip(opts, base_lrs, strict=True):
            apply_lr(opt, base, tr.lr_schedule, it)
            opt.zero_grad()
        total = 0.0
        for mb in range(microbatches):
            x, y = tr.data(it, 0, mb)
            for s, module in enumerate(stages):
                torch.manual_seed(microbatch_seed(tr.seed, it, 0, mb, s))
                x = module(x)
            loss = tr.loss(x, y)
            (loss / microbatches).backward()
            total += float(loss.detach())
        for module, opt in zip(stages, opts, strict=True):
            if tr.clip is not None:
                params = list(module.parameters())
                clip_by_norm(params, squared_norm(params), tr.clip.max_norm)
            opt.step()
        losses.append(total / microbatches)
    return losses


def test_loss_goes_down() -> None:
    tr = training(**SMALL, clip=1.0)
    losses = train(tr, num_stages=2, microbatches=4, iterations=30)
    initial, final = losses[0], sum(losses[-3:]) / 3
    assert 5.0 < initial < 6.0  # ~ ln 256 = 5.55 at random init
    assert final < initial - 1.5, losses


def test_training_fields() -> None:
    tr = training(lr=1e-3, weight_decay=0.1, warmup=4, clip=0.5, clip_scope="global", seed=3)
    assert tr.seed == 3 and tr.clip == GradClip(0.5, "global")
    assert tr.lr_schedule is not None
    assert [tr.lr_schedule(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert training(warmup=0).lr_schedule is None and training().clip is None
    opt = tr.optimizer(list(build_stage_module(tr, 0, 2).parameters()))
    assert isinstance(opt, torch.optim.AdamW)
    groups = {g["weight_decay"]: g for g in opt.param_groups}
    assert set(groups) == {0.1, 0.0} and all(g["lr"] == 1e-3 for g in opt.param_groups)
    assert all(p.ndim >= 2 for p in groups[0.1]["params"]) and all(p.ndim < 2 for p in groups[0.0]["params"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_layer": 0}, "n_layer must be at least 1"),
        ({"n_layer": 2.5}, "n_layer must be a whole number"),
        ({"n_embd": 30, "n_head": 4}, r"n_embd \(30\) must be a multiple of n_head \(4\)"),
        ({"dropout": 1.0}, "dropout"),
        ({"lr": 0}, "lr must be positive"),
        ({"lr": float("inf")}, "lr must be a finite number"),
        ({"clip": -1.0}, "max_norm must be positive"),
        ({"clip": 1.0, "clip_scope": "layer"}, "clip_scope"),
        ({"split": [3, 2]}, r"split \[3, 2\]: expected increasing layer indices in 1\.\.5"),
        ({"split": [6]}, "split"),
        ({"split": "2"}, "split must be a list"),
        ({"attn_implementation": "flash"}, "attn_implementation"),
        ({"text": "/nonexistent/file.txt"}, "cannot read"),
    ],
)
def test_bad_kwargs_are_value_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        training(**kwargs)


def test_split_must_fit_the_stages(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"split \[2\]: expected 2 increasing.*6 layers"):
        training(split=[2]).stage(0, 3)  # P = 3 needs two indices
    with pytest.raises(ValueError, match=r"3 layer.*cannot be split into 4 stages.*raise n_layer"):
        training(n_layer=1).stage(0, 4)
    sizes = [len(list(training(split=[1, 5]).stage(s, 3).children())) for s in range(3)]
    assert sizes == [1, 4, 1]
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ValueError, match="9 bytes: seq_len \\+ 1 are needed"):
        training(text=str(short))


def test_entry_point_errors_are_one_line() -> None:
    assert load_entry("examples.hf_gpt2:training", {"n_layer": 2}).clip is None
    with pytest.raises(InvalidInputError, match="n_layer must be at least 1") as info:
        load_entry("examples.hf_gpt2:training", {"n_layer": 0})
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidInputError, match="unexpected keyword argument 'layers'"):
        load_entry("examples.hf_gpt2:training", {"layers": 2})
