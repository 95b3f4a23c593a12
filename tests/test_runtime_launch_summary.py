"""The launcher's loss monitor (accounting files -> per-iteration loss, loss.csv) and its summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime_adapter.progress import JobMonitor, last_step, log_error
from runtime_adapter.summary import LaunchEvent, recovery_s, summarize

pytestmark = pytest.mark.timeout(30)


def _append(path: Path, *records: dict[str, object], torn: str = "") -> None:
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(torn)


def step(it: int, version: int = 1, **loss: float) -> dict[str, object]:
    return {"event": "step", "it": it, "version": version, **loss}


def test_loss_per_iteration_from_the_last_stage(tmp_path: Path) -> None:
    """D=2, P=2, M=2: an iteration's loss is complete when the last stage's loss_n add up to 4."""
    mon = JobMonitor(tmp_path, 2, 2, 2)
    a, b = tmp_path / "acct_0_1.jsonl", tmp_path / "acct_1_1.jsonl"
    _append(tmp_path / "acct_0_0.jsonl", step(0), step(1))  # stage 0: no loss fields
    _append(a, step(0, loss_sum=8.0, loss_n=2))
    mon.poll(now=1.0)
    assert mon.new_losses() == [] and mon.stepped[(0, 0)] == 2  # half the global batch only
    _append(b, step(0, loss_sum=4.0, loss_n=2), torn='{"event": "st')
    mon.poll(now=2.0)
    (row,) = mon.new_losses()
    assert (row.iteration, row.loss, row.version) == (0, 3.0, 1)
    # [1, 1] dies; after the rollback iteration 1 is replayed under v2 with [0, 1] hosting all 4
    with b.open("a") as f:
        f.write('ep", "it": 1, "version": 1, "loss_sum": 1.0, "loss_n": 2}\n')  # torn line completed
    _append(a, {"event": "rollback", "to": 1, "version": 2}, step(1, 2, loss_sum=6.0, loss_n=4))
    _append(a, step(2, 2, loss_sum=5.0, loss_n=4))
    mon.poll(now=3.0)
    assert [(r.iteration, r.loss, r.version) for r in mon.new_losses()] == [(1, 1.5, 2), (2, 1.25, 2)]
    _append(a, {"event": "resume", "stepped": 1}, step(1, 3, loss_sum=6.0, loss_n=4))  # replay: once
    mon.poll(now=4.0)
    assert mon.new_losses() == [] and mon.stepped[(0, 1)] == 2
    assert (tmp_path / "loss.csv").read_text().splitlines() == [
        "iteration,loss,version",
        "0,3,1",
        "1,1.5,2",
        "2,1.25,2",
    ]
    assert mon.version_seen == {1: 1.0, 2: 3.0, 3: 4.0}
    assert mon.last_loss() is not None and mon.last_loss().iteration == 2  # type: ignore[union-attr]
    assert (
        mon.status_line(3, {(1, 1)}, 5) == "schedule v3: stepped 0-2 of 5 iterations, failed [[1, 1]]"
    )  # [1, 0]: no file


def test_records_without_loss_fields_are_tolerated(tmp_path: Path) -> None:
    mon = JobMonitor(tmp_path, 1, 1, 1)
    _append(tmp_path / "acct_0_0.jsonl", step(0), step(1), {"event": "done"})
    mon.poll()
    assert mon.new_losses() == [] and mon.stepped[(0, 0)] == 2 and mon.last_loss() is None
    assert (tmp_path / "loss.csv").read_text() == "iteration,loss,version\n"


def test_last_step_and_log_error(tmp_path: Path) -> None:
    acct = tmp_path / "acct.jsonl"
    _append(acct, step(0), step(1))
    offset = acct.stat().st_size
    assert last_step(acct, 0) == 1 and last_step(acct, offset) is None
    _append(acct, {"event": "rejoin", "stepped": 1}, step(1, 2))
    assert last_step(acct, offset) == 1
    log = tmp_path / "w.log"
    log.write_text("INFO starting\nTraceback (most recent call last):\n  File x\nValueError: bad model\n")
    assert log_error(log) == "ValueError: bad model"
    log.write_text("a\nb\n\nc\nd\n")
    assert log_error(log) == "b | c | d"
    log.write_text(
        "a\nINFO running v1\nERROR __main__ data(2, 0, 0) raised IndexError: x\n"
        "error: data(2, 0, 0) raised IndexError: x\n"
    )
    assert log_error(log) == "data(2, 0, 0) raised IndexError: x"  # the worker's own line, alone
    assert log_error(tmp_path / "missing.log").startswith("(no log")


def test_summary_names_failures_recoveries_and_restores() -> None:
    died = LaunchEvent(10.0, "died", (1, 1), 1, iteration=3, code=-9)
    early = LaunchEvent(11.0, "died", (0, 0), 2, iteration=None, code=-9)
    rejoin = LaunchEvent(12.0, "rejoin", (1, 1), 2)
    restore = LaunchEvent(
        20.0, "restore", None, 3, checkpoint=4, why="stage(s) [1] lost", restarted=((0, 1), (1, 1))
    )
    seen = {1: 0.5, 2: 10.25, 4: 23.5}
    assert recovery_s(died, seen) == 0.25
    assert recovery_s(early, {1: 0.5, 2: 10.25}) is None
    lines = summarize([died, early, rejoin, restore], seen, 8, 10, 4, (7, 2.5))
    assert lines == [
        "summary: 8/10 iterations, last schedule v4, loss 2.5000 at iteration 7",
        "  failures: 2",
        "    worker [1, 1] died in iteration 3 (exit -9) under v1: training again after 0.25 s",
        "    worker [0, 0] died before its first step (exit -9) under v2: training again after 12.50 s",
        "  re-joins: 1 ([1, 1])",
        "  restores from a checkpoint: 1",
        "    stage(s) [1] lost: restored from iteration 4, restarting [0, 1], [1, 1]: training again after "
        "3.50 s",
    ]
    quiet = summarize([], {}, 5, 5, 1)
    assert quiet == [
        "summary: 5/5 iterations, last schedule v1",
        "  failures: none",
        "  restores from a checkpoint: none",
    ]


def test_a_non_finite_loss_is_warned_about_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN loss printed `loss nan` on every line and the launch ended with exit 0, nothing said."""
    from types import SimpleNamespace
    from typing import Any, cast

    from runtime_adapter.launch_cli import _Reporter
    from runtime_adapter.progress import IterationLoss

    nan, inf = float("nan"), float("inf")
    rows = [[IterationLoss(0, 1.5, 1)], [IterationLoss(1, nan, 1), IterationLoss(2, inf, 1)]]
    monitor = SimpleNamespace(poll=lambda: None, new_losses=lambda: rows.pop(0) if rows else [])
    spec = SimpleNamespace(workers=lambda: [(0, 0), (0, 1)], num_iterations=3)
    supervisor = SimpleNamespace(history=[], version=1, failed=set())
    reporter = _Reporter(cast(Any, monitor), cast(Any, spec), every=1)
    for _ in range(3):
        reporter(cast(Any, supervisor))
    out, err = capsys.readouterr()
    assert err.count("warning: the loss of iteration 1 is nan") == 1 and "iteration 2" not in err, err
    assert "loss nan" in out and "loss 1.5000" in out
