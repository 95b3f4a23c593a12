"""The validator: memory capacity, the claimed iteration time, and the figures it reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.bounds import load_bound
from planner.contract import Action, FailureScenario, JobSpec, Schedule, SlowWorker, WorkerSchedule
from planner.errors import ScheduleRuleError
from planner.simulator import replay, validate
from tests.test_simulator_structure import VALID_2X2X2, make_job, make_schedule

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# VALID_2X2X2 replays to T = 10.1 ms (see test_simulator_replay.test_hand_computed_2x2x2); peak
# memory 200 MiB on stage 0 workers, 100 MiB on stage 1 workers.


def test_figures_of_the_hand_computed_schedule() -> None:
    job = make_job(2, 2, 2, capacity=250.0)
    report = validate(job, FailureScenario(), make_schedule(VALID_2X2X2, iteration_time_ms=10.1))
    # Load bound: each stage's two peers host 2 micro-batches of F+B+W = 3 ms, + 0.4 + 0.5 = 6.9.
    assert report.lower_bound_ms == pytest.approx(6.9)
    assert report.iteration_time_ms == pytest.approx(10.1)
    assert report.gap == pytest.approx(10.1 / 6.9 - 1)
    # Busy per worker and iteration: 2 x F (1) + 2 x BW (2) + OPT (0.5) = 6.5.
    assert report.bubble_ratio == pytest.approx(1 - 4 * 6.5 / (4 * 10.1))
    assert report.peak_memory_by_stage == [pytest.approx(200.0), pytest.approx(100.0)]
    assert report.capacity_by_stage == [250.0, 250.0]
    assert report.peak_memory_mib[1, 0] == pytest.approx(200.0)
    assert report.num_iterations == 4


def test_to_dict_is_json() -> None:
    report = validate(
        make_job(2, 2, 2), FailureScenario(), make_schedule(VALID_2X2X2, iteration_time_ms=10.1)
    )
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["peak_memory_mib"]["0,1"] == pytest.approx(100.0)
    assert doc["capacity_by_stage"] == [None, None]
    assert doc["iteration_time_ms"] == pytest.approx(10.1)


def test_memory_over_capacity() -> None:
    job = make_job(2, 2, 2, capacity=150.0)
    with pytest.raises(ScheduleRuleError) as info:
        validate(job, FailureScenario(), make_schedule(VALID_2X2X2, iteration_time_ms=10.1))
    assert info.value.rule == "memory"
    assert "worker [0, 0] peaks at 200.000 MiB" in str(info.value)
    assert "150.000 MiB" in str(info.value)


def test_memory_capacity_per_stage() -> None:
    job = make_job(2, 2, 2, capacity=[200.0, 50.0])  # stage 0 exactly at capacity is fine
    with pytest.raises(ScheduleRuleError, match=r"worker \[0, 1\] peaks at 100.000 MiB") as info:
        validate(job, FailureScenario(), make_schedule(VALID_2X2X2, iteration_time_ms=10.1))
    assert info.value.rule == "memory"


def test_memory_exactly_at_capacity_passes() -> None:
    job = make_job(2, 2, 2, capacity=[200.0, 100.0])
    validate(job, FailureScenario(), make_schedule(VALID_2X2X2, iteration_time_ms=10.1))


def test_wrong_claim() -> None:
    with pytest.raises(ScheduleRuleError) as info:
        validate(make_job(2, 2, 2), FailureScenario(), make_schedule(VALID_2X2X2, iteration_time_ms=10.0))
    assert info.value.rule == "claim"


def test_claim_within_tolerance_and_unchecked() -> None:
    job = make_job(2, 2, 2)
    validate(job, FailureScenario(), make_schedule(VALID_2X2X2, iteration_time_ms=10.1 + 5e-6))
    with pytest.raises(ScheduleRuleError):
        validate(job, FailureScenario(), make_schedule(VALID_2X2X2, iteration_time_ms=10.1 + 2e-5))
    validate(job, FailureScenario(), make_schedule(VALID_2X2X2, iteration_time_ms=3.0), check_claim=False)


def one_f_one_b(job: JobSpec) -> Schedule:
    """Plain 1F1B with fused BW, every micro-batch on its own pipeline, no failure."""
    num_p, num_m = job.num_stages, job.num_microbatches
    workers = []
    for d in range(job.num_pipelines):
        for s in range(num_p):
            warmup = min(num_p - s - 1, num_m)
            acts = [Action(op="F", mb=(d, m)) for m in range(warmup)]
            for m in range(num_m):
                if m + warmup < num_m:
                    acts.append(Action(op="F", mb=(d, m + warmup)))
                acts.append(Action(op="BW", mb=(d, m)))
            acts.append(Action(op="OPT"))
            workers.append(WorkerSchedule(worker=(d, s), actions=acts))
    return Schedule(job=job.name, failed=[], iteration_time_ms=0.0, workers=workers)


def test_example_job_with_one_f_one_b() -> None:
    job = JobSpec.model_validate_json((EXAMPLES / "gpt3-13b-p8d8.json").read_text())
    schedule = one_f_one_b(job)
    schedule.iteration_time_ms = replay(job, FailureScenario(), schedule).iteration_time_ms
    report = validate(job, FailureScenario(), schedule)
    assert report.iteration_time_ms >= load_bound(job, FailureScenario())
    assert 0.0 < report.bubble_ratio < 1.0
    # 1F1B holds at most P - s activations on stage s.
    for s, peak in enumerate(report.peak_memory_by_stage):
        assert peak == pytest.approx((job.num_stages - s) * job.stages[s].activation_mib)


def gpipe_orders(
    num_pipelines: int, num_stages: int, num_microbatches: int, failed: set[tuple[int, int]], split: bool
) -> dict[tuple[int, int], list[Action]]:
    """All F in micro-batch order, then all BW (or all B then all W); failed workers' micro-batches
    dealt round-robin to their alive peers."""
    orders: dict[tuple[int, int], list[Action]] = {}
    for s in range(num_stages):
        alive = [d for d in range(num_pipelines) if (d, s) not in failed]
        hosted: dict[int, list[tuple[int, int]]] = {d: [] for d in alive}
        k = 0
        for m in range(num_microbatches):
            for d in range(num_pipelines):
                if d in hosted:
                    hosted[d].append((d, m))
                else:
                    hosted[alive[k % len(alive)]].append((d, m))
                    k += 1
        for d in alive:
            mbs = hosted[d]
            acts = [Action(op="F", mb=mb) for mb in mbs]
            backs = ("B", "W") if split else ("BW",)
            for op in backs:
                acts += [Action(op=op, mb=mb) for mb in mbs]  # type: ignore[arg-type]
            orders[d, s] = [*acts, Action(op="OPT")]
    return orders


@settings(max_examples=60, deadline=None)
@given(
    num_pipelines=st.integers(1, 3),
    num_stages=st.integers(1, 3),
    num_microbatches=st.integers(1, 4),
    split=st.booleans(),
    fail_seed=st.integers(0, 2**16),
    slow_factor=st.sampled_from([1.0, 1.5, 3.0]),
    f=st.floats(0.1, 3.0),
    b=st.floats(0.1, 3.0),
    w=st.floats(0.0, 3.0),
    hop=st.floats(0.0, 1.0),
)
def test_gpipe_orders_never_deadlock_and_respect_the_bound(
    num_pipelines: int,
    num_stages: int,
    num_microbatches: int,
    split: bool,
    fail_seed: int,
    slow_factor: float,
    f: float,
    b: float,
    w: float,
    hop: float,
) -> None:
    job = make_job(num_pipelines, num_stages, num_microbatches, f=f, b=b, w=w, act_ms=hop, cross_ms=2 * hop)
    # At most one failed worker per stage, never the last peer; the seed picks which.
    failed = {
        ((fail_seed >> s) % num_pipelines, s)
        for s in range(num_stages)
        if num_pipelines > 1 and (fail_seed >> (8 + s)) & 1
    }
    alive = [(d, s) for s in range(num_stages) for d in range(num_pipelines) if (d, s) not in failed]
    slow = [SlowWorker(worker=alive[fail_seed % len(alive)], factor=slow_factor)] if slow_factor > 1 else []
    scenario = FailureScenario(failed=sorted(failed), slow=slow)
    orders = gpipe_orders(num_pipelines, num_stages, num_microbatches, failed, split)
    schedule = Schedule(
        job=job.name,
        failed=sorted(failed),
        iteration_time_ms=0.0,
        workers=[WorkerSchedule(worker=k, actions=v) for k, v in orders.items()],
    )
    result = replay(job, scenario, schedule)
    assert result.iteration_time_ms >= load_bound(job, scenario) * (1 - 1e-9) - 1e-9
