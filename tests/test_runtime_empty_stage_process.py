"""A stage left without a layer, with real worker processes (CPU, gloo, kill -9): the reference GPT,
D=2 x P=3 x M=2, 6 blocks ([0, 2) [2, 4) [4, 6) at home).

[1, 1] is killed -9 in iteration 2; v2 (planned by the planner on planner.partition.derive_job of the
forced partition [0, 3) [3, 3) [3, 6), with the plan's `migration` estimate) leaves stage 1 no block:
its survivor [0, 1] hands block 2 to stage 0 and block 3 to stage 2 in both pipelines, then runs every
micro-batch of stage 1 as the identity (activations forward, gradients back); [1, 1] re-joins from a
warm standby, v3 (the job's own partition) moves the blocks back ([0, 1] takes block 2 from [0, 0] and
block 3 from [0, 2]) and the re-joiner copies stage 1's state from [0, 1]. Every micro-batch counted
once; losses and every worker's final parameters equal single-process training (relative error < 1e-5).
(One process: tests/test_runtime_empty_stage.py.)
"""

from __future__ import annotations

import functools
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.migration import launch_move_and_back
from runtime_adapter.accounting import iteration_losses
from runtime_adapter.assignment import Worker
from runtime_adapter.migration_job import with_derived_layers
from runtime_adapter.model import GPTConfig, gpt_training, training
from runtime_adapter.reference import relative_error, train_reference
from tests.jobs import tiny_job
from tests.test_runtime_process import TOL, assert_exactly_once, records

CFG = GPTConfig(num_layers=6)
D, P, M, N = 2, 3, 2, 12
VICTIM: Worker = (1, 1)
EMPTY = [[0, 3], [3, 3], [3, 6]]


@functools.lru_cache(maxsize=1)
def reference() -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Single-process training (one thread: see tests/test_runtime_process.reference): states, losses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses: list[float] = []
        return train_reference(gpt_training(CFG), D, P, M, N, losses=losses), losses
    finally:
        torch.set_num_threads(threads)


def migrations(out: Path, w: Worker) -> dict[int, tuple[Any, ...]]:
    """version -> (from, to, layers_in) of worker w's migration records."""
    got = [r for r in records(out, w) if r["event"] == "migration"]
    return {r["version"]: (r["from"], r["to"], r["layers_in"]) for r in got}


@pytest.mark.timeout(240)
def test_a_stage_hands_all_its_layers_over_and_takes_them_back(tmp_path: Path) -> None:
    job = with_derived_layers(tiny_job(D, P, M), training(**asdict(CFG)), optimizer_copies=1, mib_per_ms=1.0)
    launcher = launch_move_and_back(
        tmp_path, job, asdict(CFG), N, {frozenset({VICTIM}): EMPTY}, victim=VICTIM
    )
    codes = launcher.wait(timedelta(seconds=1))
    assert all(rc == 0 for rc in codes.values()) and len(codes) == D * P, codes
    moves = {w: migrations(tmp_path, w) for w in [(0, 0), (1, 0), (0, 1), (0, 2), (1, 2)]}
    assert {w: m[2] for w, m in moves.items()} == {
        (0, 0): ([0, 2], [0, 3], 1),
        (1, 0): ([0, 2], [0, 3], 1),
        (0, 1): ([2, 4], [3, 3], 0),  # stage 1's survivor gives both blocks away
        (0, 2): ([4, 6], [3, 6], 1),
        (1, 2): ([4, 6], [3, 6], 1),
    }
    assert {w: m[3] for w, m in moves.items()} == {
        (0, 0): ([0, 3], [0, 2], 0),
        (1, 0): ([0, 3], [0, 2], 0),
        (0, 1): ([3, 3], [2, 4], 2),  # and takes both back from its own pipeline
        (0, 2): ([3, 6], [4, 6], 0),
        (1, 2): ([3, 6], [4, 6], 0),
    }
    v2 = next(r for r in records(tmp_path, (0, 1)) if r["event"] == "migration" and r["version"] == 2)
    assert v2["sent_mib"] > 0 and v2["received_mib"] == 0 and v2["estimated_ms"] > 0
    empty_steps = [r for r in records(tmp_path, (0, 1)) if r["event"] == "step" and r["version"] == 2]
    assert empty_steps, "the empty stage never stepped"
    everything = [[d, m] for d in range(D) for m in range(M)]
    assert all(sorted(r["hosted"]) == everything for r in empty_steps)  # it hosts both pipelines' mbs
    rejoin = [r for r in records(tmp_path, VICTIM) if r["event"] in ("rejoin", "migration")]
    assert [r["event"] for r in rejoin][-1] == "rejoin", rejoin
    for w in codes:  # every worker ends on its home layers
        done = [r["layers"] for r in records(tmp_path, w) if r["event"] == "done"]
        assert done == [[[0, 2], [2, 4], [4, 6]][w[1]]], (w, done)
    assert_exactly_once(tmp_path, job, N)
    states, losses = reference()
    got = iteration_losses(tmp_path, D, P)
    assert sorted(got) == list(range(N)), got
    for it, loss in got.items():
        assert loss == pytest.approx(losses[it], rel=TOL), f"iteration {it}: {loss} vs {losses[it]}"
    for d, s in codes:
        err = relative_error(torch.load(tmp_path / f"final_{d}_{s}.pt"), states[s])
        assert err < TOL, f"worker [{d}, {s}]: relative error {err:.2e} vs single-process training"
