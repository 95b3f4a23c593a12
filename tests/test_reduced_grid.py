"""Planning on a reduced grid (planner/reduced.py) on Llama-3-shaped jobs: as many micro-batches as
stages, memory for twice that, many pipelines. The full schedule must validate and sit within the
bounds the benchmark reports; the reduced job must have the full job's bounds."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.adaptive.zb_delays import DELAYS, zb_delay_orders
from planner.baselines import BASELINES, baseline_schedule
from planner.bounds import load_bound, memory_bound
from planner.contract import FailureScenario, JobSpec
from planner.normalize import normalize
from planner.orders import to_schedule
from planner.plan import plan
from planner.reduced import host_variants as reduced_host_variants
from planner.reduced import reduce_job
from planner.simulator import validate
from tests import jobs


def llama_shaped(D: int = 24, P: int = 4) -> JobSpec:
    """M = P micro-batches per pipeline, capacity for 2P activations, hops and an all-reduce."""
    return jobs.uniform_job(
        D, P, P, capacity_mib=200.0 * P, activation_ms=0.01, cross_pipeline_ms=0.02, allreduce_ms=0.5
    )


def llama3_like(D: int = 20) -> JobSpec:
    """llama3-405b-p16d128's shape on D pipelines: 16 stages, 16 micro-batches, its stage profile
    (stages 0-13 alike, two lighter last stages), memory for 32 activations, its hops and all-reduce."""
    heavy = (381.164, 381.164, 343.048, 25.97, 45312.0, 15104.0)
    light = [
        (333.519, 333.519, 300.167, 22.749, 39648.0, 13216.0),
        (362.209, 362.209, 325.988, 22.749, 39648.0, 13216.0),
    ]
    keys = ("forward", "backward_input", "backward_weight", "optimizer", "activation_mib", "weight_grad_mib")
    stages = [dict(zip(keys, v, strict=True)) for v in [heavy] * 14 + light]
    return JobSpec.model_validate(
        {
            "name": "llama3-like",
            "num_pipelines": D,
            "num_stages": 16,
            "num_microbatches": 16,
            "stages": stages,
            "comm": {"activation_ms": 0.6811, "cross_pipeline_ms": 1.3622, "allreduce_ms": 127.842},
            "memory_capacity_mib": 1449984.0,
        }
    )


@pytest.mark.timeout(90)
def test_one_failure_on_llama3_shape_plans_reduced_and_validates_in_full() -> None:
    job = llama3_like()
    scenario = FailureScenario(failed=[(3, 0)])
    red = reduce_job(job, normalize(job, scenario).scenario)
    assert red is not None and red.num_pipelines == 18  # 1 touched + 16 peers taking one each + stand-in
    result = plan(job, scenario, time_limit=timedelta(seconds=2), use_cpsat=False)
    report = validate(job, scenario, result.schedule)  # the referee replays all D pipelines
    assert len(result.schedule.workers) == job.num_pipelines * job.num_stages - 1
    t, mb = result.iteration_time_ms, memory_bound(job, scenario)
    assert report.iteration_time_ms == pytest.approx(t, rel=1e-9)
    assert mb > 1.2 * load_bound(job, scenario)  # 16 micro-batches for 16 stages: warm-up idle counts
    assert mb * (1 - 1e-9) <= t <= mb * 1.05  # docs/benchmarks.md, "Llama 3's grid": 1.018
    # The untouched pipelines beyond the reduced grid run the stand-in's orders, renamed.
    by_worker = {tuple(w.worker): w for w in result.schedule.workers}
    phys = normalize(job, scenario).to_physical
    a, b = phys[red.num_pipelines], phys[-1]
    for s in range(job.num_stages):
        ops_a = [(x.op, x.mb[1] if x.mb else None, x.start_ms) for x in by_worker[a, s].actions]
        ops_b = [(x.op, x.mb[1] if x.mb else None, x.start_ms) for x in by_worker[b, s].actions]
        assert ops_a == ops_b


@pytest.mark.timeout(60)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    D=st.integers(6, 40),
    P=st.integers(2, 5),
    failed=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 4)), min_size=0, max_size=3, unique=True),
)
def test_reduced_job_keeps_both_bounds(D: int, P: int, failed: list[tuple[int, int]]) -> None:
    job = llama_shaped(D, P)
    failed = [(d, s) for d, s in failed if d < D and s < P]
    canonical = normalize(job, FailureScenario(failed=failed)).scenario
    red = reduce_job(job, canonical)
    if red is None:
        return
    assert red.num_pipelines < D
    assert load_bound(red.job, canonical) == pytest.approx(load_bound(job, canonical), rel=1e-12)
    assert memory_bound(red.job, canonical) == pytest.approx(memory_bound(job, canonical), rel=1e-12)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_memory_bound_holds_for_baselines_with_few_microbatches(name: str) -> None:
    # The bound counts the warm-up idle of a worker that hosts fewer Fs than its round trip lasts:
    # every replayed schedule must sit at or above it.
    job = llama_shaped(3, 4)
    for failed in ([], [(0, 0)], [(1, 2)]):
        scenario = FailureScenario(failed=failed)
        sched = baseline_schedule(name, job, scenario)
        assert sched.iteration_time_ms >= memory_bound(job, scenario) * (1 - 1e-9)


def test_longer_w_delays_beat_zb_h1_with_a_middle_stage_failure() -> None:
    # On Llama 3's shape a failure at a middle stage: ZB-H1 defers stage s's W by s steps; deferring
    # 2s (one more where a worker hosts a re-routed micro-batch) is faster, and the planner keeps it.
    job = llama3_like(20)
    scenario = FailureScenario(failed=[(0, 8)])
    red = reduce_job(job, scenario)
    assert red is not None and red.num_pipelines == 18
    problem = reduced_host_variants(red, scenario)[0]
    zb = to_schedule(problem, BASELINES["zb-h1"].build_orders(problem), strategy="zb-h1").iteration_time_ms
    longer = to_schedule(problem, zb_delay_orders(problem, DELAYS["zb-2s+"]), strategy="zb-2s+")
    validate(red.job, scenario, longer)
    assert longer.iteration_time_ms < zb * (1 - 0.01)
    assert memory_bound(job, scenario) <= longer.iteration_time_ms <= memory_bound(job, scenario) * 1.05
