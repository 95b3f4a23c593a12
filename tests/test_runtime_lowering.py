"""Lowering, assignments and the reference model: pure functions, no processes."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.contract import FailureScenario, JobSpec, Schedule
from planner.plan import plan
from runtime_adapter.assignment import (
    Assignment,
    assignment_from_schedule,
    assignment_from_view,
    assignments_from_schedule,
)
from runtime_adapter.lowering import (
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    check_deadlock_free,
    fifo_violations,
    lower,
)
from runtime_adapter.model import GPTConfig, SyntheticData, build_stages, cross_entropy, stage_layers
from tests.jobs import tiny_job as job


def programs(j: JobSpec, failed: list[list[int]]):
    scenario = FailureScenario.model_validate({"failed": failed})
    sched = plan(j, scenario, use_cpsat=False).schedule
    assigns = assignments_from_schedule(sched, 1, j.num_pipelines, j.num_microbatches)
    return sched, assigns, {w: lower(a) for w, a in assigns.items()}


def test_failure_free_program_shape() -> None:
    _, _, progs = programs(job(2, 2, 4), [])
    kinds0 = [i.kind for i in progs[(0, 0)].instrs]
    assert kinds0.count(SEND_ACT) == 4 and kinds0.count(RECV_GRAD) == 4
    assert RECV_ACT not in kinds0 and SEND_GRAD not in kinds0
    assert kinds0[-1] == "OPT"
    for ins in progs[(0, 0)].instrs:
        if ins.peer is not None:
            assert ins.peer == (0, 1)  # failure-free: no cross-pipeline hop
    assert fifo_violations(progs) == []  # in-order matching (NCCL) would work too
    text = progs[(0, 1)].dry_run()
    assert "RECV_ACT mb=[0, 0] <- [0, 0]" in text and text.splitlines()[-1].endswith("OPT")


def test_rerouted_microbatches_get_cross_pipeline_hops() -> None:
    _, assigns, progs = programs(job(2, 2, 4), [[1, 1]])
    assert (1, 1) not in progs
    hosted = assigns[(0, 1)].hosted()
    assert sorted(hosted) == sorted((d, m) for d in range(2) for m in range(4))
    peers_of_10 = {i.peer for i in progs[(1, 0)].instrs if i.peer is not None}
    assert peers_of_10 == {(0, 1)}  # [1, 0] sends its activations across to pipeline 0
    check_deadlock_free(progs)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    d=st.integers(2, 3),
    p=st.integers(2, 4),
    m=st.integers(1, 4),
    data=st.data(),
)
def test_lowered_planner_schedules_never_deadlock(d: int, p: int, m: int, data: st.DataObject) -> None:
    grid = [[i, s] for i in range(d) for s in range(p)]
    failed = data.draw(st.lists(st.sampled_from(grid), unique_by=tuple, max_size=p))
    if any(sum(1 for f in failed if f[1] == s) >= d for s in range(p)):
        return  # a whole stage lost: unrecoverable, never planned
    _, _, progs = programs(job(d, p, m), failed)
    check_deadlock_free(progs)
    # every micro-batch's activation crosses every stage boundary exactly once
    sends = [(w, i.mb) for w, pr in progs.items() for i in pr.instrs if i.kind == SEND_ACT]
    assert len(sends) == len(set(sends)) == d * m * (p - 1)


def test_deadlock_is_detected() -> None:
    sched, _, _ = programs(job(1, 2, 2), [])
    bad = json.loads(sched.model_dump_json())
    for ws in bad["workers"]:
        if ws["worker"] == [0, 1]:  # stage 1 insists on micro-batch 1 first; stage 0 waits on 0's grad
            ws["actions"] = [
                {"op": "F", "mb": [0, 1]}, {"op": "F", "mb": [0, 0]}, {"op": "B", "mb": [0, 0]},
                {"op": "W", "mb": [0, 0]}, {"op": "B", "mb": [0, 1]}, {"op": "W", "mb": [0, 1]},
                {"op": "OPT"},
            ]  # fmt: skip
        else:
            ws["actions"] = [
                {"op": "F", "mb": [0, 0]}, {"op": "B", "mb": [0, 0]}, {"op": "W", "mb": [0, 0]},
                {"op": "F", "mb": [0, 1]}, {"op": "B", "mb": [0, 1]}, {"op": "W", "mb": [0, 1]},
                {"op": "OPT"},
            ]  # fmt: skip
    assigns = assignments_from_schedule(Schedule.model_validate(bad), 1, 1, 2)
    with pytest.raises(ValueError, match="deadlock"):
        check_deadlock_free({w: lower(a) for w, a in assigns.items()})


def test_order_without_opt_is_rejected() -> None:
    a = Assignment(1, (0, 0), 1, 1, 1, frozenset(), (("F", (0, 0)), ("BW", (0, 0))))
    with pytest.raises(ValueError, match="end with OPT"):
        lower(a)


def test_view_and_schedule_give_the_same_assignment() -> None:
    sched, assigns, _ = programs(job(2, 3, 2), [[1, 1]])
    doc = json.loads(sched.model_dump_json())
    hosts = {}
    for ws in doc["workers"]:
        for act in ws["actions"]:
            if act["op"] == "F":
                hosts[(ws["worker"][1], tuple(act["mb"]))] = ws["worker"]
    for w, a in assigns.items():
        acts = next(ws["actions"] for ws in doc["workers"] if tuple(ws["worker"]) == w)
        routes = [
            {"mb": x["mb"], "prev_host": hosts.get((w[1] - 1, tuple(x["mb"]))),
             "next_host": hosts.get((w[1] + 1, tuple(x["mb"])))}
            for x in acts if x["op"] == "F"
        ]  # fmt: skip
        view = {
            "version": 1, "worker": list(w), "failed": doc["failed"], "routes": routes, "actions": acts,
            "stage_alive": [ws["worker"] for ws in doc["workers"] if ws["worker"][1] == w[1]],
        }  # fmt: skip
        assert assignment_from_view(view, 2, 3, 2) == a
        assert a == assignment_from_schedule(sched, 1, w, 2, 2)


def test_stage_split_composes_to_the_whole_model() -> None:
    cfg = GPTConfig(num_layers=5)
    assert [len(r) for r in stage_layers(5, 3)] == [2, 2, 1]
    stages2, stages1 = build_stages(cfg, 2), build_stages(cfg, 1)
    tokens, targets = SyntheticData(cfg).microbatch(0, 0, 0)
    loss1 = cross_entropy(stages1[0](tokens), targets)
    # same seed, same parameter draws in the same order: a 2-stage split computes the same function
    loss2 = cross_entropy(stages2[1](stages2[0](tokens)), targets)
    assert torch.allclose(loss1, loss2, rtol=1e-6)


def test_synthetic_data_is_keyed() -> None:
    data = SyntheticData(GPTConfig())
    a, b = data.microbatch(3, 1, 2), data.microbatch(3, 1, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], data.microbatch(3, 1, 3)[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are the next tokens
