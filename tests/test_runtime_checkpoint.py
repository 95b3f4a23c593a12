"""Checkpoint fallback: atomic per-stage files, the newest complete iteration, and a whole stage lost
in a real D=2, P=2 run (the launcher restarts every worker from the checkpoint)."""

from __future__ import annotations

from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_adapter import checkpoint
from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.publishers import lost_stages
from tests.jobs import tiny_job
from tests.test_runtime_process import (
    CFG,
    assert_exactly_once,
    assert_matches_reference,
    assert_peers_identical,
    planner_schedules,
    records,
)


def _state(value: float) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    return {"w": torch.full((3,), value)}, {"state": {}, "param_groups": [{"lr": value, "params": [0]}]}


def test_save_is_atomic_keeps_the_newest_and_loads_back(tmp_path: Path) -> None:
    for k in range(1, 7):
        checkpoint.save_stage(tmp_path, 1, 2 * k, *_state(float(k)))
    assert checkpoint.stage_iterations(tmp_path, 1) == {8, 10, 12}  # KEEP = 3 newest
    assert not [p for p in (tmp_path / "stage1").iterdir() if not p.name.endswith(".pt")]  # no tmp files
    state = checkpoint.load_stage(tmp_path, 1, 10)
    assert state["stepped"] == 10 and torch.equal(state["model"]["w"], torch.full((3,), 5.0))
    (tmp_path / "stage1" / ".it00000014.pt.tmp123").write_bytes(b"torn")  # a writer died mid-write
    assert checkpoint.stage_iterations(tmp_path, 1) == {8, 10, 12}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.integers(0, 12), max_size=5), min_size=1, max_size=4))
def test_latest_complete_is_the_newest_iteration_every_stage_has(per_stage: list[set[int]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for s, its in enumerate(per_stage):
            (Path(d) / f"stage{s}").mkdir()
            for k in its:
                checkpoint.stage_file(Path(d), s, k).write_bytes(b"")
        common = set.intersection(*per_stage)
        assert checkpoint.latest_complete(Path(d), len(per_stage)) == (max(common) if common else None)


def test_lost_stages() -> None:
    assert lost_stages({(0, 1), (1, 1)}, 2, 2) == [1]
    assert lost_stages({(0, 1), (1, 0)}, 2, 2) == []
    assert lost_stages(set(), 3, 2) == []


@pytest.mark.timeout(150)
def test_whole_stage_lost_restarts_from_the_checkpoint(tmp_path: Path) -> None:
    """Both workers of stage 1 are killed -9 in iteration 5 (checkpoints every 2 iterations): the
    launcher restarts all four from the checkpoint at 4, iteration 4 onwards is replayed, and the final
    parameters equal failure-free training."""
    job, n = tiny_job(2, 2), 8
    spec = LaunchSpec(
        job, asdict(CFG), n, tmp_path, fail_at={(0, 1): (5, "F"), (1, 1): (5, "F")}, checkpoint_every=2
    )
    launcher = Launcher(spec, planner_schedules(job))  # type: ignore[arg-type]
    launcher.start()
    codes = launcher.wait(timedelta(seconds=140))
    assert all(rc == 0 for rc in codes.values()), codes
    assert launcher.restores == 1, launcher.events
    (restore,) = [e for e in launcher.history if e.kind == "restore"]
    assert restore.checkpoint == 4 and "stage(s) [1] lost" in restore.why  # what the summary reports
    workers = spec.workers()
    for w in workers:
        resumed = [r["stepped"] for r in records(tmp_path, w) if r["event"] == "resume"]
        assert resumed == [4], (w, resumed)
    assert checkpoint.latest_complete(spec.checkpoints, 2) == n
    assert_exactly_once(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, workers)
    assert_peers_identical(tmp_path, job)
