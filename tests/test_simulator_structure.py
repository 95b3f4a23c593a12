"""Structure rules of CONTRACT.md section 3: the simulator rejects hand-broken schedules.

Also home of the tiny builders the other simulator tests use: orders are written by hand as
strings like "F00 F01 BW00 BW01 OPT" (op, then the micro-batch's pipeline digit and index digit).
"""

from __future__ import annotations

import re

import pytest

from planner.contract import Action, FailureScenario, JobSpec, Schedule, WorkerSchedule
from planner.errors import InvalidInputError, ScheduleRuleError, UnrecoverableScenarioError
from planner.simulator import replay

_TOKEN = re.compile(r"^(F|B|W|BW)(\d)(\d)$")


def make_job(
    num_pipelines: int,
    num_stages: int,
    num_microbatches: int,
    *,
    f: float = 1.0,
    b: float = 1.0,
    w: float = 1.0,
    opt: float = 0.5,
    act_mib: float = 100.0,
    wgrad_mib: float = 40.0,
    act_ms: float = 0.1,
    cross_ms: float = 0.3,
    allreduce_ms: float | list[float] = 0.4,
    capacity: float | list[float] | None = None,
) -> JobSpec:
    """A job whose every stage has the same profile."""
    stage = {
        "forward": f,
        "backward_input": b,
        "backward_weight": w,
        "optimizer": opt,
        "activation_mib": act_mib,
        "weight_grad_mib": wgrad_mib,
    }
    return JobSpec.model_validate(
        {
            "name": "tiny",
            "num_pipelines": num_pipelines,
            "num_stages": num_stages,
            "num_microbatches": num_microbatches,
            "stages": [stage] * num_stages,
            "comm": {"activation_ms": act_ms, "cross_pipeline_ms": cross_ms, "allreduce_ms": allreduce_ms},
            "memory_capacity_mib": capacity,
        }
    )


def parse_order(text: str) -> list[Action]:
    """'F00 BW00 OPT' -> actions."""
    actions = []
    for tok in text.split():
        if tok == "OPT":
            actions.append(Action(op="OPT"))
            continue
        match = _TOKEN.match(tok)
        assert match, tok
        actions.append(Action(op=match[1], mb=(int(match[2]), int(match[3]))))  # type: ignore[arg-type]
    return actions


def make_schedule(
    orders: dict[tuple[int, int], str],
    failed: list[tuple[int, int]] | None = None,
    iteration_time_ms: float = 0.0,
    job: str = "tiny",
) -> Schedule:
    return Schedule(
        job=job,
        failed=list(failed or []),
        iteration_time_ms=iteration_time_ms,
        workers=[WorkerSchedule(worker=w, actions=parse_order(o)) for w, o in orders.items()],
    )


# D=2, P=2, M=2, fused backward, no failure; a valid schedule (its times are in test_simulator_replay).
VALID_2X2X2 = {
    (0, 0): "F00 F01 BW00 BW01 OPT",
    (1, 0): "F10 F11 BW10 BW11 OPT",
    (0, 1): "F00 BW00 F01 BW01 OPT",
    (1, 1): "F10 BW10 F11 BW11 OPT",
}


def broken(**changes: str) -> dict[tuple[int, int], str]:
    """VALID_2X2X2 with some workers' orders replaced; keys like w01 = worker [0, 1]."""
    orders = dict(VALID_2X2X2)
    for name, text in changes.items():
        orders[int(name[1]), int(name[2])] = text
    return orders


def rule_of(orders: dict[tuple[int, int], str], scenario: FailureScenario | None = None, **kw: object) -> str:
    job = make_job(2, 2, 2)
    with pytest.raises(ScheduleRuleError) as info:
        replay(job, scenario or FailureScenario(), make_schedule(orders, **kw))  # type: ignore[arg-type]
    return info.value.rule


def test_valid_schedule_passes() -> None:
    result = replay(make_job(2, 2, 2), FailureScenario(), make_schedule(VALID_2X2X2))
    assert result.iteration_time_ms > 0


def test_missing_op() -> None:
    assert rule_of(broken(w11="F10 BW10 F11 OPT")) == "coverage"


def test_missing_forward() -> None:
    assert rule_of(broken(w11="F10 BW10 BW11 OPT")) == "coverage"


def test_duplicate_op() -> None:
    assert rule_of(broken(w00="F00 F01 F00 BW00 BW01 OPT")) == "coverage"


def test_duplicate_op_on_two_hosts() -> None:
    assert rule_of(broken(w10="F10 F11 F01 BW10 BW11 OPT")) == "coverage"


def test_wrong_host() -> None:
    # F [0, 1] at stage 1 on [0, 1], its BW on [1, 1].
    assert rule_of(broken(w01="F00 BW00 F01 OPT", w11="F10 BW10 F11 BW01 BW11 OPT")) == "host"


def test_w_before_b() -> None:
    split = broken(w01="F00 B00 W00 F01 W01 B01 OPT")
    assert rule_of(split) == "order"


def test_backward_before_forward() -> None:
    assert rule_of(broken(w01="BW00 F00 F01 BW01 OPT")) == "order"


def test_mixed_backward() -> None:
    assert rule_of(broken(w01="F00 B00 BW00 F01 BW01 OPT")) == "mixed-backward"


def test_b_without_w() -> None:
    assert rule_of(broken(w01="F00 B00 F01 BW01 OPT")) == "coverage"


def test_two_opts() -> None:
    assert rule_of(broken(w00="F00 F01 BW00 OPT BW01 OPT")) == "opt"


def test_opt_not_last() -> None:
    assert rule_of(broken(w00="F00 F01 BW00 OPT BW01")) == "opt"


def test_no_opt() -> None:
    assert rule_of(broken(w00="F00 F01 BW00 BW01")) == "opt"


def test_failed_worker_present() -> None:
    scenario = FailureScenario(failed=[(1, 1)])
    orders = broken(w01="F00 BW00 F01 BW01 F10 BW10 F11 BW11 OPT")
    assert rule_of(orders, scenario, failed=[(1, 1)]) == "workers"


def test_alive_worker_missing() -> None:
    orders = dict(VALID_2X2X2)
    del orders[1, 1]
    orders[0, 1] = "F00 BW00 F01 BW01 F10 BW10 F11 BW11 OPT"
    assert rule_of(orders) == "workers"


def test_worker_outside_grid() -> None:
    orders = dict(VALID_2X2X2)
    orders[2, 0] = "OPT"
    assert rule_of(orders) == "workers"


def test_microbatch_out_of_range() -> None:
    assert rule_of(broken(w00="F00 F01 F02 BW00 BW01 OPT")) == "mb-range"


def test_failed_set_must_match() -> None:
    assert rule_of(VALID_2X2X2, failed=[(1, 1)]) == "failed-set"


def test_job_name_must_match() -> None:
    assert rule_of(VALID_2X2X2, job="other") == "job"


def test_rerouted_schedule_is_valid() -> None:
    scenario = FailureScenario(failed=[(1, 1)])
    orders = {k: v for k, v in VALID_2X2X2.items() if k != (1, 1)}
    orders[0, 1] = "F00 BW00 F10 BW10 F01 BW01 F11 BW11 OPT"
    replay(make_job(2, 2, 2), scenario, make_schedule(orders, failed=[(1, 1)]))


def test_scenario_outside_grid_is_invalid_input() -> None:
    with pytest.raises(InvalidInputError):
        replay(make_job(2, 2, 2), FailureScenario(failed=[(5, 0)]), make_schedule(VALID_2X2X2))


def test_unrecoverable_scenario() -> None:
    with pytest.raises(UnrecoverableScenarioError):
        replay(make_job(2, 2, 2), FailureScenario(failed=[(0, 1), (1, 1)]), make_schedule(VALID_2X2X2))


def test_message_names_the_culprit() -> None:
    job = make_job(2, 2, 2)
    with pytest.raises(ScheduleRuleError, match=r"micro-batch \[1, 1\] at stage 1 has no backward"):
        replay(job, FailureScenario(), make_schedule(broken(w11="F10 BW10 F11 OPT")))
