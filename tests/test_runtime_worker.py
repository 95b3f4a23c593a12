"""In-process checks of the worker's pieces: the loss and the "stepping" record around the all-reduce
(executor), the destruction of old versions' groups (comm.GroupReaper), and the witness rules of the
accounting files (accounting.py). One rank, gloo on a HashStore: no processes, a few seconds."""

from __future__ import annotations

import json
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from planner.contract import FailureScenario
from planner.plan import plan
from runtime_adapter.accounting import Accounting, committed, iteration_losses
from runtime_adapter.assignment import Assignment, assignments_from_schedule
from runtime_adapter.comm import GroupReaper, build_groups
from runtime_adapter.executor import REDUCED, Executor, IterationRecord
from runtime_adapter.lowering import Instr
from runtime_adapter.model import GPTConfig, SyntheticData, cross_entropy, gpt_training
from runtime_adapter.stage import StageRunner
from tests.jobs import tiny_job

pytestmark = pytest.mark.timeout(120)

CFG = GPTConfig()


def one_worker(version: int = 1) -> Assignment:
    """The assignment of the only worker of a 1 x 1 job (4 micro-batches)."""
    schedule = plan(tiny_job(1, 1), FailureScenario(failed=[]), use_cpsat=False).schedule
    return assignments_from_schedule(schedule, version, 1, 4)[(0, 0)]


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class SpyGroup:
    """Wraps a process group and logs the all-reduces into `events`."""

    def __init__(self, pg: Any, events: list[str]) -> None:
        self.pg, self.events = pg, events

    def allreduce(self, tensors: list[torch.Tensor], *args: Any) -> Any:
        self.events.append("allreduce")
        return self.pg.allreduce(tensors, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pg, name)


def test_stepping_precedes_the_allreduce_and_the_loss_is_unscaled() -> None:
    torch.manual_seed(0)
    events: list[str] = []
    stepping: list[IterationRecord] = []

    def before_step(rec: IterationRecord) -> None:
        events.append("stepping")
        stepping.append(rec)

    def fault(iteration: int, ins: Instr) -> None:
        if ins is REDUCED:
            events.append("reduced")

    runner = StageRunner(gpt_training(CFG), 0, 1, torch.device("cpu"), [])
    module = runner.build()
    ex = Executor(module, runner, (0, 0), 1, 4, fault, before_step=before_step)
    a = one_worker()
    groups = build_groups(dist.HashStore(), a, ex.interrupted, "gloo", timedelta(seconds=10))
    groups.stage = SpyGroup(groups.stage, events)
    ex.apply(a, groups)
    # the losses the executor must report: unscaled mean loss of each micro-batch, before the step
    data = SyntheticData(CFG)
    with torch.no_grad():
        expected = [
            float(cross_entropy(module(x), y)) for x, y in (data.microbatch(0, 0, m) for m in range(4))
        ]
    rec = ex.run_iteration(0)
    assert events == ["stepping", "allreduce", "reduced"]
    assert stepping == [rec] and ex.stepped == 1
    assert rec.loss_n == 4 and rec.loss_sum == pytest.approx(sum(expected), rel=1e-6)
    rec = ex.run_iteration(1)
    assert rec.loss_n == 4 and events[-3:] == ["stepping", "allreduce", "reduced"]
    groups.close()


def test_the_reaper_destroys_old_groups_and_their_threads() -> None:
    reaper, store, stop = GroupReaper(), dist.HashStore(), threading.Event()
    current = None
    counts = []
    for version in range(1, 7):
        a = one_worker(version)
        groups = reaper.track(build_groups(store, a, stop, "gloo", timedelta(seconds=10)))
        t = torch.ones(3)
        groups.waiter.wait(groups.stage.allreduce([t]), "all-reduce")
        if current is not None:
            reaper.retire(current)
        current = groups
        assert reaper.drain(10)
        counts.append((reaper.live(), os_threads()))
    assert all(live == 2 for live, _ in counts), counts  # the current version's world and stage groups
    assert max(n for _, n in counts) <= counts[0][1] + 2, counts  # no threads left behind per version


def write(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_witness_counts_a_maybe_stepped_worker_confirmed_by_its_peer(tmp_path: Path) -> None:
    """Stage 1 of D=2, P=2, M=1: iteration 0 stepped at v1 by both; iteration 1 at v1: [1, 1] wrote
    "stepping" and died before its "step"; [0, 1] stepped. Iteration 2 was stepped at v1 by [0, 1],
    then rolled back and replayed at v2 by [0, 1] alone."""
    step = {"event": "step", "wall_ms": 1.0, "op_ms": {}}
    w0 = [
        {"event": "stepping", "it": 0, "version": 1, "hosted": [[0, 0]], "loss_sum": 2.0, "loss_n": 1},
        {**step, "it": 0, "version": 1, "hosted": [[0, 0]], "loss_sum": 2.0, "loss_n": 1},
        {"event": "stepping", "it": 1, "version": 1, "hosted": [[0, 0]], "loss_sum": 1.0, "loss_n": 1},
        {**step, "it": 1, "version": 1, "hosted": [[0, 0]], "loss_sum": 1.0, "loss_n": 1},
        {"event": "stepping", "it": 2, "version": 1, "hosted": [[0, 0]], "loss_sum": 9.0, "loss_n": 1},
        {**step, "it": 2, "version": 1, "hosted": [[0, 0]], "loss_sum": 9.0, "loss_n": 1},
        {"event": "rollback", "to": 2, "version": 2},
        {
            "event": "stepping",
            "it": 2,
            "version": 2,
            "hosted": [[0, 0], [1, 0]],
            "loss_sum": 1.0,
            "loss_n": 2,
        },
        {**step, "it": 2, "version": 2, "hosted": [[0, 0], [1, 0]], "loss_sum": 1.0, "loss_n": 2},
    ]
    w1 = [
        {"event": "stepping", "it": 0, "version": 1, "hosted": [[1, 0]], "loss_sum": 4.0, "loss_n": 1},
        {**step, "it": 0, "version": 1, "hosted": [[1, 0]], "loss_sum": 4.0, "loss_n": 1},
        {"event": "stepping", "it": 1, "version": 1, "hosted": [[1, 0]], "loss_sum": 3.0, "loss_n": 1},
    ]
    write(tmp_path / "acct_0_1.jsonl", w0)
    write(tmp_path / "acct_1_1.jsonl", w1)
    got = committed(tmp_path, 2, 2)
    hosts = {k: sorted(mb for r in recs for mb in r["hosted"]) for k, recs in got.items()}
    assert hosts == {(1, 0): [[0, 0], [1, 0]], (1, 1): [[0, 0], [1, 0]], (1, 2): [[0, 0], [1, 0]]}
    assert iteration_losses(tmp_path, 2, 2) == {0: 3.0, 1: 2.0, 2: 0.5}


def test_accounting_writes_loss_fields_only_on_the_last_stage(tmp_path: Path) -> None:
    rec = IterationRecord(3, 2, [(0, 1)], {"F": 1.0}, 5.0, loss_sum=1.5, loss_n=1)
    for last in (True, False):
        path = tmp_path / f"acct_{int(last)}.jsonl"
        acct = Accounting(path, last)
        acct.stepping(rec)
        acct.step(rec)
        acct.close()
        stepping, step = (json.loads(line) for line in path.read_text().splitlines())
        assert stepping["event"] == "stepping" and step["event"] == "step"
        assert stepping["it"] == step["it"] == 3 and stepping["hosted"] == step["hosted"] == [[0, 1]]
        assert ("loss_sum" in step) == last and ("loss_n" in stepping) == last


def test_incarnation_verdicts() -> None:
    """What a worker does with a version under the restore protocol and fencing (incarnation.py)."""
    from dataclasses import replace

    from runtime_adapter.assignment import Assignment, RestorePoint
    from runtime_adapter.incarnation import Incarnation, Verdict

    base = Assignment(2, (0, 1), 2, 2, 1, frozenset(), (), joined_at=1)
    inc = Incarnation()
    assert inc.judge(replace(base, state="needs_restore")) is Verdict.NEEDS_RESTORE  # policy manual
    assert inc.judge(replace(base, state="needs_restore", restore_policy="auto")) is Verdict.WAIT
    assert inc.judge(replace(base, failed=frozenset({(0, 1)}))) is Verdict.DROPPED
    assert inc.judge(replace(base, failed=frozenset({(0, 1)})), fresh=True) is Verdict.WAIT
    assert inc.judge(base) is Verdict.RUN
    inc.took_part(base)
    assert inc.joined == 1 and inc.judge(replace(base, version=3)) is Verdict.RUN
    assert inc.judge(replace(base, version=3, joined_at=None)) is Verdict.RUN  # no fencing information
    restore = replace(base, version=5, restore=RestorePoint(1, 4), joined_at=5)
    assert inc.judge(restore) is Verdict.RESTORE
    inc.restored(restore)
    assert (inc.epoch, inc.joined) == (1, 5) and inc.judge(replace(restore, version=6)) is Verdict.RUN
    assert not inc.fenced
    assert inc.judge(replace(restore, version=8, joined_at=8)) is Verdict.FENCED and inc.fenced
    started = Incarnation(epoch=1)  # restarted for epoch 1 with --resume-at: no reload
    assert started.judge(restore) is Verdict.RUN
