"""The round-trip and first-F conflict terms of the memory-aware bound (planner/bounds.py
`around_ms`, planner/bounds_conflict.py, docs/planner.md section 2): with few micro-batches per
pipeline, stage 0's cycle must wrap around the busiest worker of a later stage, which starts an F
late where an earlier stage lost a worker. They never exceed a valid schedule (brute force on tiny
jobs, random valid and planned schedules on small ones) and are reached where they bind."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.bounds import load_bound, memory_bound
from planner.contract import FailureScenario, JobSpec
from planner.errors import ScheduleRuleError
from planner.plan import plan
from planner.simulator import validate
from planner.simulator.engine import replay_orders
from tests import jobs
from tests.strategies import recoverable_scenarios, small_jobs
from tests.test_bounds_valid import Op, Worker, interleavings, random_orders, schedule_of, steady_time


def ample(job: JobSpec) -> JobSpec:
    """`job` with a capacity that holds every activation: only the round-trip term can bind."""
    need = (
        job.num_pipelines
        * job.num_microbatches
        * max(s.activation_mib + s.weight_grad_mib for s in job.stages)
    )
    return job.model_copy(update={"memory_capacity_mib": need})


def test_round_trip_by_hand() -> None:
    # 1 pipeline, 3 stages, 4 micro-batches, every op 1 ms: stage 2's 4 F+B pairs (8 ms) sit between
    # the F path to it (2 ms) and the B path back (2 ms), then W at stage 0 and OPT (2 ms): 14 ms,
    # above the load bound (4 x 3 + 1 = 13 ms), and the planner reaches it.
    job = jobs.uniform_job(1, 3, 4, capacity_mib=10_000.0)
    assert load_bound(job, FailureScenario()) == pytest.approx(13.0)
    assert memory_bound(job, FailureScenario()) == pytest.approx(14.0)
    assert plan(job, FailureScenario(), use_cpsat=False).iteration_time_ms == pytest.approx(14.0)


def every_schedule(job: JobSpec) -> list[dict[Worker, list[Op]]]:
    """Every order of every worker of a one-pipeline job (split B/W): most deadlock."""
    chains: list[list[Op]] = [
        [("F", (0, m)), ("B", (0, m)), ("W", (0, m))] for m in range(job.num_microbatches)
    ]
    per_worker = [interleavings(chains) for _ in range(job.num_stages)]
    return [
        {(0, s): [*o, ("OPT", None)] for s, o in enumerate(combo)} for combo in itertools.product(*per_worker)
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_against_every_schedule(seed: int) -> None:
    """Brute force on 1 pipeline x 2 stages x 2 micro-batches, a light stage 0 and a heavy stage 1
    (random times): the bound is the round trip (F0, hop, 2 x (F1+B1), hop, B0, W0, OPT) and every
    schedule needs at least that; the best one needs exactly that."""
    rng = random.Random(seed)
    base = jobs.uniform_job(1, 2, 2, capacity_mib=10_000.0, activation_ms=0.1, cross_pipeline_ms=0.2)
    f0, b0, f1, b1 = (round(rng.uniform(lo, hi), 3) for lo, hi in ((0.5, 1), (0.5, 1), (1.5, 3), (1.5, 3)))
    stages = [
        base.stages[0].model_copy(update={"forward": f0, "backward_input": b0}),
        base.stages[1].model_copy(update={"forward": f1, "backward_input": b1}),
    ]
    job = base.model_copy(update={"stages": stages})
    times = []
    for orders in every_schedule(job):
        try:
            report = validate(
                job, FailureScenario(), schedule_of(job, FailureScenario(), orders), check_claim=False
            )
        except ScheduleRuleError as exc:  # a deadlocking order is no schedule
            assert exc.rule == "deadlock", exc
            continue
        times.append(report.iteration_time_ms)
    bound = memory_bound(job, FailureScenario())
    assert bound == pytest.approx(f0 + 0.1 + 2 * (f1 + b1) + 0.1 + b0 + 1.0 + 1.0)  # W0 = OPT = 1 ms
    assert bound <= min(times) * (1 + 1e-9)
    assert bound == pytest.approx(min(times))


@pytest.mark.timeout(150)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_round_trip_holds_for_random_and_planned_schedules(data: st.DataObject, seed: int) -> None:
    """Few micro-batches per stage (M <= P), a capacity that holds everything: random valid
    schedules and the planner's greedy plan are never below the bound."""
    job = ample(data.draw(small_jobs(max_d=3, max_p=4, max_m=3, memory=False)))
    scenario = data.draw(recoverable_scenarios(job))
    t = steady_time(job, scenario, random_orders(job, scenario, random.Random(seed)))
    assert t is not None
    bound = memory_bound(job, scenario)
    assert bound <= t * (1 + 1e-9)
    planned = plan(job, scenario, use_cpsat=False).iteration_time_ms
    assert bound <= planned * (1 + 1e-9)


def every_hosted_schedule(job: JobSpec, scenario: FailureScenario) -> list[dict[Worker, list[Op]]]:
    """Every host map and every split-B/W order on every worker (a fused BW never beats B then W
    on the same worker: the B's dependants wait less)."""
    num_d, num_p = job.num_pipelines, job.num_stages
    mbs = [(d, m) for d in range(num_d) for m in range(job.num_microbatches)]
    per_stage = []
    for s in range(num_p):
        alive = [d for d in range(num_d) if (d, s) not in scenario.failed]
        options: list[dict[Worker, list[Op]]] = []
        for hosts in itertools.product(alive, repeat=len(mbs)):
            chains: dict[int, list[list[Op]]] = {d: [] for d in alive}
            for mb, h in zip(mbs, hosts, strict=True):
                chains[h].append([("F", mb), ("B", mb), ("W", mb)])
            per_worker = [[((d, s), o) for o in interleavings(chains[d])] for d in alive]
            options.extend(dict(c) for c in itertools.product(*per_worker))
        per_stage.append(options)
    return [
        {w: [*o, ("OPT", None)] for part in combo for w, o in part.items()}
        for combo in itertools.product(*per_stage)
    ]


@pytest.mark.timeout(120)
def test_first_f_conflict_against_every_schedule() -> None:
    """2 pipelines x 3 stages x 1 micro-batch, worker [1,1] failed, a heavy last stage: stage 1's
    one alive worker runs both Fs, so one pipeline's last stage starts an F late. The bound
    (round trip 12 ms + that F, 1 ms) is 13 ms, above every other term, and the best schedule."""
    base = jobs.uniform_job(2, 3, 1, capacity_mib=10_000.0)
    heavy = base.stages[2].model_copy(update={"forward": 3.0, "backward_input": 3.0})
    job = base.model_copy(update={"stages": [base.stages[0], base.stages[1], heavy]})
    scenario = FailureScenario(failed=[(1, 1)])
    times = []
    for orders in every_hosted_schedule(job, scenario):
        try:
            times.append(replay_orders(job, scenario, orders).iteration_time_ms)
        except ScheduleRuleError as exc:
            assert exc.rule == "deadlock", exc
    assert memory_bound(job, scenario) == pytest.approx(13.0)
    assert min(times) == pytest.approx(13.0)
