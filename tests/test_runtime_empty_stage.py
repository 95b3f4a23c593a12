"""A stage that a re-partition leaves without a layer, in one process (real gloo groups on a HashStore,
one thread per worker; the multi-process run with kill -9 is tests/test_runtime_empty_stage_process.py).

- the empty stage's module: the reference GPT's middle StageModule without a block has no parameter and
  returns its input itself; stage 0 and the last keep their embedding and head; a layer-list model's
  empty stage is the identity;
- `build_optimizer`: `NoParameters` where torch optimizers refuse an empty list; its state dict
  survives a rollback, the re-join copy (state bytes) and a checkpoint;
- a whole D=1 x P=3 pipeline (AdamW, global-norm clipping) that moves the middle stage's block away
  ([0, 2) [2, 3) [3, 4) -> [0, 3) [3, 3) [3, 4)), runs with the empty stage (fused BW and split B/W
  orders, a rollback and replay), moves the block back and matches single-process training, losses
  and parameters layer by layer;
- the re-joiner of an empty stage builds its empty module and takes its veteran peer's state.
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from runtime_adapter import checkpoint
from runtime_adapter.assignment import Assignment, MicroBatch
from runtime_adapter.comm import Groups, build_groups
from runtime_adapter.executor import Executor
from runtime_adapter.migration import Migrator
from runtime_adapter.migration_plan import to_global
from runtime_adapter.model import GPTConfig, StageModule, gpt_training
from runtime_adapter.reference import model_wide, relative_error, train_reference
from runtime_adapter.stage import StageRunner, infer_shapes
from runtime_adapter.training import (
    GradClip,
    NoParameters,
    Training,
    build_optimizer,
    layer_ranges_from_layers,
    stages_from_layers,
)

pytestmark = pytest.mark.timeout(120)

CFG = GPTConfig(num_layers=4)  # 3 stages: [0, 2) [2, 3) [3, 4) at home
P, M = 3, 2
HOME = [range(0, 2), range(2, 3), range(3, 4)]
EMPTY = (range(0, 3), range(3, 3), range(3, 4))  # stage 1 gives its block to stage 0
TIMEOUT = timedelta(seconds=30)
TOL = 1e-5


def adamw_training() -> Training:
    return gpt_training(CFG, optimizer="adamw", clip=0.5, clip_scope="global")


def test_the_empty_middle_stage_is_the_identity() -> None:
    empty = StageModule(CFG, 1, 3, range(2, 2))
    assert list(empty.parameters()) == [] and len(empty.blocks) == 0
    x = torch.randn(2, CFG.seq_len, CFG.hidden)
    assert empty(x) is x
    first, last = StageModule(CFG, 0, 3, range(0, 0)), StageModule(CFG, 2, 3, range(4, 4))
    assert {n.split(".")[0] for n, _ in first.named_parameters()} == {"tok", "pos"}
    assert {n.split(".")[0] for n, _ in last.named_parameters()} == {"ln_f", "head"}
    ranges = layer_ranges_from_layers(lambda: [torch.nn.Linear(4, 4) for _ in range(3)])
    layer_list = ranges.build(1, 3, range(1, 1))
    assert list(layer_list.parameters()) == [] and layer_list(x) is x


def test_no_parameters_gets_the_placeholder_optimizer() -> None:
    t = adamw_training()
    with pytest.raises(ValueError, match="empty parameter list"):
        t.optimizer([])
    opt = build_optimizer(t, [])
    assert isinstance(opt, NoParameters) and opt.step() is None
    state = opt.state_dict()
    assert state == {"state": {}, "param_groups": [{"lr": 0.0, "params": []}]}
    opt.load_state_dict(state)
    assert isinstance(build_optimizer(t, list(torch.nn.Linear(2, 2).parameters())), torch.optim.AdamW)


def assignment(s: int, version: int, fused: bool, partition: tuple[range, ...] | None) -> Assignment:
    """Worker [0, s] of the D=1 x P=3 x M=2 pipeline: all F, then all BW (or all B, all W), then OPT."""
    mbs: list[MicroBatch] = [(0, m) for m in range(M)]
    back = [("BW", mb) for mb in mbs] if fused else [*(("B", mb) for mb in mbs), *(("W", mb) for mb in mbs)]
    actions = (*(("F", mb) for mb in mbs), *back, ("OPT", None))
    prev = {mb: (0, s - 1) if s > 0 else None for mb in mbs}
    nxt = {mb: (0, s + 1) if s < P - 1 else None for mb in mbs}
    return Assignment(
        version, (0, s), 1, P, M, frozenset(), actions, prev, nxt, stage_alive=((0, s),), partition=partition
    )


def on_every_stage(body: Any) -> list[Any]:
    """body(s) in one thread per stage (they talk over gloo); the results in stage order. Every
    thread's error is reported (a failing stage leaves the others to time out on gloo)."""
    with ThreadPoolExecutor(P) as pool:
        futures = [pool.submit(body, s) for s in range(P)]
    errors = [e for f in futures if (e := f.exception()) is not None]
    assert not errors, errors
    return [f.result() for f in futures]


class Worker:
    """One stage's executor and migrator, driven version by version."""

    def __init__(self, training: Training, s: int, store: dist.Store) -> None:
        runner = StageRunner(training, s, P, torch.device("cpu"), infer_shapes(training, P))
        self.ex = Executor(runner.build(), runner, (0, s), 1, M)
        self.migrator, self.s, self.store = Migrator(self.ex, P), s, store
        self.losses: dict[int, float] = {}
        self.moves: list[tuple[int, list[int] | None, list[int], int]] = []  # (version, from, to, layers in)
        self.while_moved: tuple[int, str, dict[str, list[int]]] | None = (
            None  # (parameters, optimizer, where)
        )

    def version(self, a: Assignment, migrate: bool) -> Groups:
        """Version `a`'s groups; with `migrate`, every stage takes part in its migration (worker.py:
        unless every worker is settled)."""
        groups = build_groups(self.store, a, threading.Event(), "gloo", TIMEOUT, prefix=f"v{a.version}")
        if migrate:
            r = self.migrator.migrate(a, groups, fresh=False)
            self.moves.append((r["version"], r["from"], r["to"], r["layers_in"]))
        self.ex.apply(a, groups)
        return groups

    def iterate(self, until: int) -> None:
        while self.ex.stepped < until:
            rec = self.ex.run_iteration(self.ex.stepped)
            if rec.loss_sum is not None:
                self.losses[rec.iteration] = rec.loss_sum / rec.loss_n


def layer_list_training() -> Training:
    """Four Linear+Tanh layers of width 8 (every boundary the same shape, the data's too), SGD with
    momentum, global-norm clipping: a model whose first and last stages can be empty as well."""

    def layers() -> list[torch.nn.Module]:
        torch.manual_seed(3)
        return [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)]

    def data(it: int, d: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * it + 10 * d + m)
        return torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)

    return Training(
        stage=stages_from_layers(layers),
        data=data,
        loss=torch.nn.functional.mse_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        clip=GradClip(0.5, "global"),
        layer_ranges=layer_ranges_from_layers(layers),
    )


def run_pipeline(training: Training, moved: tuple[range, ...]) -> list[Worker]:
    """Two iterations at home; v2 moves to `moved` and runs iteration 2 (fused BW), rolls every stage
    back and replays it; v3 runs 3-4 with split B/W; v4 moves home and runs 5."""
    store = dist.HashStore()
    workers = [Worker(training, s, store) for s in range(P)]
    last_groups: list[Groups] = []

    def body(s: int) -> None:
        w = workers[s]
        w.version(assignment(s, 1, True, None), migrate=False)
        w.iterate(2)
        g = w.version(assignment(s, 2, True, moved), migrate=True)  # the migration to the empty stage
        w.iterate(3)
        w.while_moved = (len(w.ex.params), type(w.ex.optimizer).__name__, w.migrator.where())
        w.ex.rollback_to(2)  # as after a failure: every stage back to 2, iteration 2 replayed
        w.iterate(3)
        w.ex.apply(assignment(s, 3, False, moved), g)  # split backward (B, then W)
        w.iterate(5)
        last_groups.append(w.version(assignment(s, 4, False, None), migrate=True))  # the layers go home
        w.iterate(6)

    try:
        on_every_stage(body)
    finally:
        for g in last_groups:
            g.close()
    return workers


def assert_matches_reference(training: Training, workers: list[Worker]) -> None:
    losses: list[float] = []
    ref = train_reference(training, 1, P, M, 6, losses=losses)
    got = workers[-1].losses
    assert sorted(got) == list(range(6))
    for it, loss in got.items():
        assert loss == pytest.approx(losses[it], rel=TOL), f"iteration {it}"
    for s, w in enumerate(workers):
        err = relative_error(w.ex.module.state_dict(), ref[s])
        assert err < TOL, f"stage {s}: relative error {err:.2e}"


@pytest.mark.parametrize(
    ("make", "moved"),
    [
        (adamw_training, EMPTY),  # the middle stage gives its block to stage 0: the identity
        (layer_list_training, (range(0, 0), range(0, 4), range(4, 4))),  # first and last empty
    ],
    ids=["gpt-middle", "layers-first-last"],
)
def test_a_pipeline_runs_and_migrates_through_an_empty_stage(make: Any, moved: tuple[range, ...]) -> None:
    training = make()
    workers = run_pipeline(training, moved)
    for w, home, there in zip(workers, HOME, moved, strict=True):
        span = [[home.start, home.stop], [there.start, there.stop]]
        expect = [
            (2, span[0], span[1], len(set(there) - set(home))),
            (4, span[1], span[0], len(set(home) - set(there))),
        ]
        assert w.moves == expect, (w.moves, expect)
        if not there:  # the empty stage: no parameter (these have no embedding or head), NoParameters
            assert w.while_moved == (0, "NoParameters", {"layers": span[1]}), w.while_moved
        assert w.migrator.layers == home
    assert_matches_reference(training, workers)


def test_a_rejoiner_takes_an_empty_stage_state_and_a_checkpoint_holds_it(tmp_path: Path) -> None:
    training = adamw_training()
    shapes = infer_shapes(training, P)

    def migrator() -> Migrator:
        runner = StageRunner(training, 1, P, torch.device("cpu"), shapes)
        return Migrator(Executor(runner.build(), runner, (0, 1), 2, M), P)

    a = Assignment(2, (1, 1), 2, P, M, frozenset(), (), partition=EMPTY)
    veteran, rejoiner = migrator(), migrator()
    veteran._adopt(EMPTY[1], {}, {}, keep=True)  # it gave its block away
    assert veteran.ex.state_bytes() and not veteran.ex.params
    rejoiner.reshape(a)  # worker.py: a fresh re-joiner reshapes, then takes its peer's state
    rejoiner.ex.load_state_bytes(veteran.ex.state_bytes(), 7)
    assert rejoiner.ex.stepped == 7 and isinstance(rejoiner.ex.optimizer, NoParameters)
    assert rejoiner.where() == {"layers": [3, 3]} and rejoiner.settled(a, fresh=False)
    ex = rejoiner.ex
    checkpoint.save_stage(tmp_path, 1, 7, ex.module.state_dict(), ex.optimizer.state_dict())
    loaded = checkpoint.load_stage(tmp_path, 1, 7)
    assert loaded["model"] == {} and loaded["optim"] == ex.optimizer.state_dict()
    ex.load_state(loaded, 7)
    blob = io.BytesIO(ex.state_bytes())
    assert torch.load(blob, weights_only=True) == {"model": {}, "optim": ex.optimizer.state_dict()}


def test_model_wide_names_compare_any_range_with_the_reference() -> None:
    ref = train_reference(gpt_training(CFG), 1, P, M, 0)  # the initial parameters, by home stage
    whole = model_wide(ref, HOME, "blocks.")
    assert sorted({k.split(".")[1] for k in whole if k.startswith("blocks.")}) == ["0", "1", "2", "3"]
    assert torch.equal(whole["blocks.3.mlp.0.weight"], ref[2]["blocks.0.mlp.0.weight"])
    assert torch.equal(whole["blocks.2.mlp.0.weight"], ref[1]["blocks.0.mlp.0.weight"])
    stage2 = StageModule(CFG, 2, P, range(2, 4))  # stage 2 holding blocks 2-3 (local 0-1)
    stage2.load_state_dict({k: whole[to_global(k, range(2, 4), "blocks.")] for k in stage2.state_dict()})
    got = model_wide([stage2.state_dict(), {}], [range(2, 4), range(4, 4)], "blocks.")
    assert relative_error(got, {k: whole[k] for k in got}) == 0.0 and "blocks.3.ln1.weight" in got
    assert torch.equal(got["blocks.2.attn.in_proj_weight"], ref[1]["blocks.0.attn.in_proj_weight"])
