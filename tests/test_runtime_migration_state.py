"""Layer migration in one process (no groups): what moves with a layer and what a restore after a
migration loads (runtime_adapter/migration.py; the multi-process runs are in
tests/test_runtime_migration.py).

- AdamW's state (step counts, both moments) moves exactly, whatever order the Training's optimizer
  puts its parameter groups in: a stage that takes a layer and then steps equals one that always
  held it; gradients are not moved.
- the new module is built without random initialisation yet with its deterministic buffers;
- a worker whose layers moved and that loads a checkpoint (which holds its stage's own layers) is
  back on its own layers with the checkpoint's state;
- while layers are moved no stage writes checkpoints, so the last complete one survives pruning.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from runtime_adapter import checkpoint
from runtime_adapter.assignment import Assignment
from runtime_adapter.executor import Executor
from runtime_adapter.migration import Migrator
from runtime_adapter.model import GPTConfig, training
from runtime_adapter.stage import StageRunner
from runtime_adapter.training import Training, layer_ranges_from_layers, split_bounds, stages_from_layers
from runtime_adapter.worker_options import WorkerOptions
from runtime_adapter.worker_restore import StageCheckpoints

LAYERS = 4


def _layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 8) for _ in range(LAYERS)]


def _two_groups(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with biases (no weight decay) first, weights second: not the module's order."""
    biases = [p for p in params if p.dim() == 1]
    weights = [p for p in params if p.dim() > 1]
    groups = [{"params": biases, "weight_decay": 0.0}, {"params": weights, "weight_decay": 0.1}]
    return torch.optim.AdamW(groups, lr=0.01)


def _six() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 8) for _ in range(6)]


def split(n: int, p: int) -> list[range]:
    b = split_bounds(n, p)
    return [range(b[s], b[s + 1]) for s in range(p)]


def _migrator(stage: int, num_stages: int = 2, layers: Any = _layers) -> Migrator:
    t = Training(
        stage=stages_from_layers(layers),
        data=lambda it, d, m: (torch.zeros(2, 8), torch.zeros(2, 8)),
        loss=torch.nn.functional.mse_loss,
        optimizer=_two_groups,
        layer_ranges=layer_ranges_from_layers(layers),
    )
    runner = StageRunner(t, stage, num_stages, torch.device("cpu"), [(2, 8)] * (num_stages - 1))
    return Migrator(Executor(runner.build(), runner, (0, stage), 1, 1), num_stages)


def _step(m: Migrator, x: torch.Tensor) -> None:
    """One optimizer step of m's module on the sum of its outputs (deterministic gradients)."""
    m.ex.optimizer.zero_grad()
    m.ex.module(x).pow(2).sum().backward()
    m.ex.optimizer.step()


def _moved(part: list[list[int]]) -> Assignment:
    return Assignment(2, (0, 0), 1, 2, 1, frozenset(), (), partition=tuple(range(a, b) for a, b in part))


def _unpack(blob: torch.Tensor) -> dict[str, Any]:
    return dict(torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True))


def test_adamw_state_moves_exactly_and_gradients_do_not() -> None:
    src, dst = _migrator(0), _migrator(1)
    x = torch.linspace(-1, 1, 16).reshape(2, 8)
    for _ in range(3):
        _step(src, x)
        _step(dst, src.ex.module(x).detach())
    assert all(p.grad is not None for p in src.ex.params)
    blob = _unpack(src._pack((1,)))  # stage 0 gives layer 1 to stage 1
    assert set(blob["model"]) == {"1.weight", "1.bias"} and set(blob["optim"]) == set(blob["model"])
    assert all(v["step"].item() == 3 for v in blob["optim"].values())
    dst._adopt(range(1, 4), blob["model"], blob["optim"], keep=True)
    assert all(p.grad is None for p in dst.ex.params)  # no gradient moved (nor kept)
    state = {n: dst.ex.optimizer.state[p] for n, p in dst.ex.module.named_parameters()}
    assert [state[f"{j}.weight"]["step"].item() for j in range(3)] == [3, 3, 3]
    for name in ("weight", "bias"):  # layer 1 is dst's local 0 now: the source's moments, bit for bit
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[f"0.{name}"][k], blob["optim"][f"1.{name}"][k])
    # the weight-decay groups follow the parameters (biases 0.0, weights 0.1), not state positions
    decay = {id(p): g["weight_decay"] for g in dst.ex.optimizer.param_groups for p in g["params"]}
    assert [decay[id(p)] for p in dst.ex.params] == [0.1, 0.0] * 3
    # the same gradient on layer 1 here and on the source: the same update, bit for bit
    for m, local in ((src, "1"), (dst, "0")):
        for n, p in m.ex.module.named_parameters():
            p.grad = torch.full_like(p, 0.25) if n.startswith(local + ".") else None
        m.ex.optimizer.step()
    for name in ("weight", "bias"):
        assert torch.equal(dict(dst.ex.module.named_parameters())[f"0.{name}"],
                           dict(src.ex.module.named_parameters())[f"1.{name}"])  # fmt: skip
    # dst's own layers kept their state: its local 1, 2 are the model's 2, 3 (stage 1's before)
    assert [int(k.split(".")[0]) for k in dst.ex.module.state_dict()] == [0, 0, 1, 1, 2, 2]


def test_the_new_module_skips_random_init_and_keeps_its_buffers() -> None:
    cfg = GPTConfig(hidden=32, num_heads=2, num_layers=4, seq_len=8)
    t = training(**{f: getattr(cfg, f) for f in ("hidden", "num_heads", "num_layers", "seq_len")})
    runner = StageRunner(t, 1, 2, torch.device("cpu"), [(2, 8, 32)])
    m = Migrator(Executor(runner.build(), runner, (0, 1), 1, 1), 2)
    torch.manual_seed(123)
    module = m._build(range(1, 4))
    after = torch.randn(1)
    torch.manual_seed(123)
    assert torch.equal(torch.randn(1), after)  # the build drew nothing from the global generator
    expected = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)
    assert all(torch.equal(b.mask, expected) for b in module.blocks)  # type: ignore[union-attr]


def test_a_restore_after_a_migration_loads_the_stage_own_layers() -> None:
    m = _migrator(0)
    x = torch.linspace(-1, 1, 16).reshape(2, 8)
    _step(m, x)
    saved = io.BytesIO()
    torch.save({"model": m.ex.module.state_dict(), "optim": m.ex.optimizer.state_dict()}, saved)
    model = {k: v.clone() for k, v in m.ex.module.state_dict().items()}
    _step(m, x)
    m._adopt(range(0, 3), {"2.weight": torch.ones(8, 8), "2.bias": torch.zeros(8)}, {}, keep=True)
    assert m.layers == range(0, 3)
    m.reshape_home()  # StageCheckpoints._home before every load
    saved.seek(0)
    m.ex.load_state(torch.load(saved, weights_only=True), 1)
    assert m.layers == range(0, 2) and m.where() == {"layers": [0, 2]}
    for k, v in model.items():
        assert torch.equal(m.ex.module.state_dict()[k], v), k
    assert m.ex.optimizer.state_dict()["state"][0]["step"].item() == 1
    assert m.settled(_moved([[0, 2], [2, 4]]), fresh=False) and not m.settled(_moved([[0, 3], [3, 4]]), False)


def test_no_stage_checkpoints_while_layers_are_moved(tmp_path: Path) -> None:
    """P=3, 6 layers; v2 moves layer 1 from stage 0 to stage 1 and leaves stage 2 alone. Stage 2 must
    not write on (its pruning would delete its part of the last complete checkpoint, KEEP saves
    later); back home, it writes again."""
    root = tmp_path / "ck"
    for s, layers in enumerate(split(6, 3)):  # the complete checkpoint at 2, from before the move
        module = torch.nn.Sequential(*_six()[layers.start : layers.stop])
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        checkpoint.save_stage(root, s, 2, module.state_dict(), opt.state_dict())
    m = _migrator(2, num_stages=3, layers=_six)
    opts = WorkerOptions((0, 2), 1, 3, 1, 20, {}, "", 0, tmp_path, checkpoint_dir=root, checkpoint_every=2)
    logged: list[dict[str, Any]] = []
    saves = StageCheckpoints(opts, m.ex, logged.append, lambda k: None, m)

    def at(version: int, part: list[list[int]]) -> Assignment:
        ranges = tuple(range(a, b) for a, b in part)
        return Assignment(version, (0, 2), 1, 3, 1, frozenset(), (), stage_alive=((0, 2),), partition=ranges)

    moved = at(2, [[0, 1], [1, 4], [4, 6]])
    assert m.settled(moved, fresh=False) and m.moved(moved)  # stage 2 itself keeps its layers
    for k in range(4, 12, 2):
        m.ex.stepped = k
        saves.maybe_save(moved)
    saves.close()
    assert not logged and checkpoint.latest_complete(root, 3) == 2
    m.ex.stepped = 12
    saves.maybe_save(at(3, [[0, 2], [2, 4], [4, 6]]))
    saves.close()
    assert [r["stepped"] for r in logged] == [12] and checkpoint.stage_iterations(root, 2) == {2, 12}
