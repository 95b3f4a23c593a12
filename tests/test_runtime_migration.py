"""Layer migration with real worker processes (CPU, gloo, kill -9): the reference GPT, D=2 x P=2,
4 blocks ([0, 2) and [2, 4) when nothing moved). Schedules with a `partition` are planned by the
planner on the derived stage-level job (planner.partition.derive_job) and carry the plan's
`migration` estimate.

- a move and a move back: [1, 0] is killed, v2 moves block 1 from stage 0 to stage 1 ([0, 1) / [1, 4))
  in both pipelines (both receivers get it from [0, 0], the only live holder); [1, 0] re-joins, v3
  moves it back; final parameters equal single-process training, every micro-batch counted once.
- a sender killed during the move back (tests/migration_entry.py kills it while it builds its new
  module, i.e. after its sends completed and before the commit all-reduce: the receiver holds the
  whole payload): nobody switches, v4 (stage 1 short in pipeline 0: [0, 3) / [3, 4)) re-plans from
  the live holders, [1, 1] (a peer in another pipeline) sends blocks 1-2; the re-joiner takes
  stage 0's new state from its peer; parameters equal single-process training, compared layer by layer.
- a receiver killed in the middle of the first move (`--fail-at 2:MIGRATE` on [1, 1]): nobody
  switches, v3 (pipeline 1 gone) re-plans the same move from [0, 0], the only live holder.
- the pure planning (migration_plan.plan_transfers), property-based, stages holding no layer included.
(tests/test_runtime_migration_state.py: what moves with a layer, in one process.)
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.migration import VICTIM, launch_move_and_back, partitioned_schedules
from runtime_adapter.assignment import Assignment, Worker
from runtime_adapter.executor import Executor
from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.migration import MigrationUnsupported, Migrator
from runtime_adapter.migration_job import with_derived_layers
from runtime_adapter.migration_plan import plan_transfers
from runtime_adapter.model import training
from runtime_adapter.reference import model_wide, relative_error
from runtime_adapter.stage import StageRunner
from runtime_adapter.training import Training, layer_ranges_from_layers, stages_from_layers
from tests.jobs import tiny_job
from tests.test_runtime_process import (
    CFG,
    TOL,
    assert_exactly_once,
    assert_losses_match,
    assert_matches_reference,
    records,
    reference,
)

pytestmark = pytest.mark.timeout(120)

MOVED = {frozenset({VICTIM}): [[0, 1], [1, 4]], frozenset({(0, 1)}): [[0, 3], [3, 4]]}


def run(out: Path, n: int, model: dict[str, Any], entry: str | None = None) -> Launcher:
    """[1, 0] killed in iteration 2 (v2 moves block 1 to stage 1), back once the survivors stepped
    twice under v2 (bench.migration.launch_move_and_back); [1, 0]'s replacement finished."""
    job = with_derived_layers(tiny_job(2, 2, 2), training(**asdict(CFG)), optimizer_copies=1, mib_per_ms=1.0)
    launcher = launch_move_and_back(out, job, model, n, MOVED, entry)
    assert launcher.wait(timedelta(seconds=1))[VICTIM] == 0
    return launcher


def migrations(out: Path, w: Worker) -> list[dict[str, Any]]:
    return [r for r in records(out, w) if r["event"] == "migration"]


def test_move_a_layer_and_back(tmp_path: Path) -> None:
    n = 12
    launcher = run(tmp_path, n, asdict(CFG))
    assert all(rc == 0 for rc in launcher.wait(timedelta(seconds=1)).values())
    by_version = {w: {r["version"]: r for r in migrations(tmp_path, w)} for w in [(0, 0), (0, 1), (1, 1)]}
    v2 = {w: (m[2]["from"], m[2]["to"], m[2]["layers_in"]) for w, m in by_version.items()}
    assert v2 == {(0, 0): ([0, 2], [0, 1], 0), (0, 1): ([2, 4], [1, 4], 1), (1, 1): ([2, 4], [1, 4], 1)}
    assert by_version[(0, 0)][2]["sent_mib"] > 0 and by_version[(0, 0)][2]["estimated_ms"] > 0
    back = {w: (m[3]["from"], m[3]["to"]) for w, m in by_version.items()}
    assert back == {(0, 0): ([0, 1], [0, 2]), (0, 1): ([1, 4], [2, 4]), (1, 1): ([1, 4], [2, 4])}
    for w, least in [((0, 0), 2), ((0, 1), 1)]:  # training went on under the moved partition
        assert sum(1 for r in records(tmp_path, w) if r["event"] == "step" and r["version"] == 2) >= least
    job = tiny_job(2, 2, 2)
    assert_exactly_once(tmp_path, job, n)
    assert_losses_match(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, [(0, 0), (0, 1), (1, 0), (1, 1)])


HOME = [range(0, 2), range(2, 4)]


def test_sender_killed_during_the_migration(tmp_path: Path) -> None:
    n = 12
    model = {**asdict(CFG), "die_building": [0, 1, 2, 4]}  # [0, 1] dies building [2, 4) in v3
    launcher = run(tmp_path, n, model, entry="tests.migration_entry:training")
    codes = launcher.wait(timedelta(seconds=1))
    assert codes[(0, 1)] == -9 and all(codes[w] == 0 for w in [(0, 0), (1, 0), (1, 1)]), codes
    assert not any(r["version"] == 3 for w in [(0, 0), (1, 1)] for r in migrations(tmp_path, w))
    v4 = {
        w: (m["from"], m["to"])
        for w in [(0, 0), (1, 1)]
        for m in migrations(tmp_path, w)
        if m["version"] == 4
    }
    assert v4 == {(0, 0): ([0, 1], [0, 3]), (1, 1): ([1, 4], [3, 4])}, v4
    assert [r["layers"] for r in records(tmp_path, (1, 0)) if r["event"] == "done"] == [[0, 3]]
    job = tiny_job(2, 2, 2)
    assert_exactly_once(tmp_path, job, n)
    assert_losses_match(tmp_path, job, n)
    ref = reference(2, 2, 2, n)
    whole = model_wide(ref, HOME, "blocks.")
    for d, s in [(0, 0), (1, 0), (1, 1)]:
        done = next(r for r in records(tmp_path, (d, s)) if r["event"] == "done")
        final = torch.load(tmp_path / f"final_{d}_{s}.pt")
        got = model_wide([final], [range(*done["layers"])], "blocks.")
        err = relative_error(got, {k: whole[k] for k in got})
        assert err < TOL, f"worker [{d}, {s}]: relative error {err:.2e}"


def test_receiver_killed_during_the_migration(tmp_path: Path) -> None:
    n, job = 8, tiny_job(2, 2, 2)
    laid = with_derived_layers(job, training(**asdict(CFG)), optimizer_copies=1, mib_per_ms=1.0)
    moved = {frozenset({VICTIM}): [[0, 1], [1, 4]], frozenset({VICTIM, (1, 1)}): [[0, 1], [1, 4]]}
    fail_at = {VICTIM: (2, "F"), (1, 1): (2, "MIGRATE")}  # [1, 1] dies in v2's migration
    launcher = Launcher(
        LaunchSpec(laid, asdict(CFG), n, tmp_path, fail_at=fail_at), partitioned_schedules(laid, moved)
    )
    launcher.start()
    codes = launcher.wait(timedelta(seconds=600))
    assert codes == {(0, 0): 0, (0, 1): 0, VICTIM: -9, (1, 1): -9}, codes
    got = {w: [(m["version"], m["from"], m["to"]) for m in migrations(tmp_path, w)] for w in [(0, 0), (0, 1)]}
    assert got == {(0, 0): [(3, [0, 2], [0, 1])], (0, 1): [(3, [2, 4], [1, 4])]}, got  # v2: nobody switched
    assert [r["layers"] for r in records(tmp_path, (0, 1)) if r["event"] == "done"] == [[1, 4]]
    assert_exactly_once(tmp_path, job, n)
    assert_losses_match(tmp_path, job, n)
    ref = reference(2, 2, 2, n)
    whole = model_wide(ref, HOME, "blocks.")
    for (d, s), layers in [((0, 0), range(0, 1)), ((0, 1), range(1, 4))]:
        got_state = model_wide([torch.load(tmp_path / f"final_{d}_{s}.pt")], [layers], "blocks.")
        err = relative_error(got_state, {k: whole[k] for k in got_state})
        assert err < TOL, f"worker [{d}, {s}]: relative error {err:.2e}"


@st.composite
def layouts(draw: st.DrawFn) -> tuple[dict[Worker, range | None], list[range]]:
    """Random alive workers of D x P holding random (per-worker) partitions, and a target partition;
    with `empty`, stages may hold no layer (a stage receiving nothing, or giving everything)."""
    D, P = draw(st.integers(1, 3)), draw(st.integers(2, 4))
    n, empty = draw(st.integers(P, P + 4)), draw(st.booleans())

    def partition() -> list[range]:
        if empty:
            cuts = sorted(draw(st.lists(st.integers(0, n), min_size=P - 1, max_size=P - 1)))
        else:
            cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=P - 1, max_size=P - 1)))
        b = [0, *cuts, n]
        return [range(b[s], b[s + 1]) for s in range(P)]

    held: dict[Worker, range | None] = {}
    for d in range(D):
        for s in range(P):
            kind = draw(st.sampled_from(["alive", "alive", "dead", "fresh"]))
            if kind != "dead":
                held[(d, s)] = partition()[s] if kind == "alive" else None
    return held, partition()


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_plan_gives_every_worker_its_layers(case: tuple[dict[Worker, range | None], list[range]]) -> None:
    held, target = case
    covered = set().union(*[set(r) for r in held.values() if r is not None])
    try:
        transfers = plan_transfers(held, target)
    except RuntimeError:
        needed = {x for w, r in held.items() if r is not None for x in target[w[1]]}
        assert needed - covered  # refused only when a needed layer has no live holder
        return
    for w, r in held.items():
        got = set(r or ()) | {x for t in transfers if t.dst == w for x in t.layers}
        assert r is None or set(target[w[1]]) <= got
    for t in transfers:
        src = held[t.src]
        assert src is not None and set(t.layers) <= set(src) and t.src != t.dst
        same = [w for w, r in held.items() if w[0] == t.dst[0] and r is not None and set(t.layers) & set(r)]
        assert not same or t.src[0] == t.dst[0] or any(w == t.src for w in same)


def layered_model(with_ranges: bool) -> Migrator:
    """Stage 0 of 2 of a 4-layer model from `stages_from_layers`, in an executor; its Migrator."""

    def layers() -> list[torch.nn.Module]:
        return [torch.nn.Linear(8, 8) for _ in range(4)]

    t = Training(
        stage=stages_from_layers(layers),
        data=lambda it, d, m: (torch.zeros(2, 8), torch.zeros(2, 8)),
        loss=torch.nn.functional.mse_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        layer_ranges=layer_ranges_from_layers(layers) if with_ranges else None,
    )
    runner = StageRunner(t, 0, 2, torch.device("cpu"), [(2, 8)])
    return Migrator(Executor(runner.build(), runner, (0, 0), 1, 1), 2)


def moved(version: int, part: list[list[int]]) -> Assignment:
    ranges = tuple(range(a, b) for a, b in part)
    return Assignment(version, (0, 0), 1, 2, 1, frozenset(), (), partition=ranges)


def test_a_model_without_layer_ranges_refuses_a_partition() -> None:
    m = layered_model(with_ranges=False)
    assert m.partition(moved(2, [[0, 2], [2, 4]])) is None  # the even split: nothing moves
    with pytest.raises(MigrationUnsupported, match=r"schedule v3 moves layers .* no layer_ranges"):
        m.partition(moved(3, [[0, 1], [1, 4]]))


def test_a_model_from_layer_ranges_reshapes() -> None:
    m = layered_model(with_ranges=True)
    assert m.layers == range(0, 2) and not m.settled(moved(2, [[0, 3], [3, 4]]), fresh=False)
    m.reshape(moved(2, [[0, 3], [3, 4]]))
    assert m.layers == range(0, 3) and len(list(m.ex.module.children())) == 3 and len(m.ex.params) == 6
    with pytest.raises(MigrationUnsupported, match="partition has 2 ranges over 5 layers"):
        m.partition(moved(3, [[0, 3], [3, 5]]))
