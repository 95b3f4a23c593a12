"""planner.partition (issue 12): derive_job, the partition search and the re-partition planner."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.bounds import load_bound
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError, ScheduleRuleError
from planner.partition import derive_job, layer_model, migration
from planner.partition.choose import plan_repartition
from planner.partition.search import best_partition, partition_bound, stage_costs
from planner.simulator import validate
from tests.strategies import recoverable_scenarios

FIELDS = ("forward", "backward_input", "backward_weight", "activation_mib", "weight_grad_mib")


@st.composite
def compositions(draw: st.DrawFn, num_layers: int, num_stages: int, empty: bool = False) -> list[list[int]]:
    """A random contiguous split of num_layers layers into num_stages ranges, non-empty unless
    `empty` (then a stage may hold no layer, as a schedule's partition may)."""
    lo, hi = (0, num_layers) if empty else (1, num_layers - 1)
    cuts = sorted(draw(st.lists(st.integers(lo, hi), min_size=num_stages - 1,
                                max_size=num_stages - 1, unique=not empty)))  # fmt: skip
    bounds = [0, *cuts, num_layers]
    return [[bounds[i], bounds[i + 1]] for i in range(num_stages)]


@st.composite
def layered_jobs(draw: st.DrawFn, max_d: int = 3, max_p: int = 3, max_m: int = 4) -> JobSpec:
    """A small job with given per-layer figures, a random layer map and stage extras."""
    D, P, M = draw(st.integers(2, max_d)), draw(st.integers(2, max_p)), draw(st.integers(1, max_m))
    L = draw(st.integers(P, P + 4))
    part = draw(compositions(L, P))
    t = st.floats(0.2, 3.0).map(lambda x: round(x, 3))
    layers = [
        {"forward": draw(t), "backward_input": draw(t), "backward_weight": draw(t),
         "activation_mib": draw(st.sampled_from([10.0, 20.0])), "weight_grad_mib": 5.0,
         "param_mib": draw(st.sampled_from([0.0, 4.0, 8.0])), "optimizer_state_mib": 12.0}
        for _ in range(L)
    ]  # fmt: skip
    stages = []
    for s, (a, b) in enumerate(part):
        extra = draw(st.sampled_from([0.0, 0.5])) if s in (0, P - 1) else 0.0
        fig = {f: sum(x[f] for x in layers[a:b]) + (extra if f == "forward" else 0.0) for f in FIELDS}  # type: ignore[misc]
        stages.append({**fig, "optimizer": round(0.1 * (b - a), 3)})
    cap = draw(st.sampled_from([None, 400.0, 1000.0]))
    return JobSpec.model_validate(
        {"name": "layered", "num_pipelines": D, "num_stages": P, "num_microbatches": M, "stages": stages,
         "comm": {"activation_ms": 0.05, "cross_pipeline_ms": 0.1, "allreduce_ms": 0.5},
         "memory_capacity_mib": cap, "layers": layers, "partition": part}
    )  # fmt: skip


def _total(job: JobSpec, field: str) -> float:
    return sum(float(getattr(p, field)) for p in job.stages)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_derive_job_conserves_work_and_memory(data: st.DataObject) -> None:
    job = data.draw(layered_jobs())
    model = layer_model(job)
    part = data.draw(compositions(model.num_layers, job.num_stages, empty=True))
    try:
        derived = derive_job(job, part)
    except InvalidInputError as exc:  # the layers' state does not fit: named, and really over
        assert "memory_capacity_mib: stage" in str(exc)
        return
    for field in FIELDS:
        assert _total(derived, field) == pytest.approx(_total(job, field))
    if job.memory_capacity_mib is not None:
        caps = [derived.capacity_mib(s) for s in range(job.num_stages)]
        total = sum(job.capacity_mib(s) for s in range(job.num_stages))  # type: ignore[misc]
        assert sum(caps) == pytest.approx(total)  # type: ignore[arg-type]
    assert derive_job(derived, part) is derived  # its own partition: unchanged
    assert JobSpec.model_validate_json(derived.model_dump_json()) == derived  # a job spec, round trip
    assert derive_job(job, model.partition) is job
    mig = migration(job, part)
    assert (mig.mib == 0) == (part == model.partition or model.resident_mib(0, model.num_layers) == 0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_search_is_exact_and_no_worse_than_the_job_partition(data: st.DataObject) -> None:
    job = data.draw(layered_jobs())
    scenario = data.draw(recoverable_scenarios(job, max_failures=3, slow=True))
    model = layer_model(job)
    costs = stage_costs(job, model, scenario)
    best, found = best_partition(costs)
    own = partition_bound(costs, model.partition)
    assert best <= own * (1 + 1e-9)
    brute = float("inf")  # every split, stages with no layer included
    for cuts in itertools.combinations_with_replacement(range(model.num_layers + 1), job.num_stages - 1):
        b = [0, *cuts, model.num_layers]
        brute = min(brute, partition_bound(costs, [[b[i], b[i + 1]] for i in range(job.num_stages)]))
    assert best == pytest.approx(brute)
    if found is not None:
        assert load_bound(derive_job(job, found), scenario) == pytest.approx(best)
        assert partition_bound(costs, found) == pytest.approx(best)


@pytest.mark.timeout(60)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_chosen_schedule_validates_and_beats_reroute(data: st.DataObject) -> None:
    job = data.draw(layered_jobs(max_d=3, max_p=3, max_m=3))
    scenario = data.draw(recoverable_scenarios(job, max_failures=2, slow=False))
    try:
        rep = plan_repartition(job, scenario, use_cpsat=False)
    except InvalidInputError as exc:
        assert "memory_capacity_mib: " in str(exc)
        return
    reroute_ms = rep.reroute_load_bound_ms if rep.reroute is None else rep.reroute.iteration_time_ms
    assert rep.iteration_time_ms <= reroute_ms * (1 + 1e-9)
    assert rep.load_bound_ms <= rep.reroute_load_bound_ms * (1 + 1e-9) or not rep.repartitioned
    assert rep.best_load_bound_ms <= rep.load_bound_ms * (1 + 1e-9)
    sched = rep.result.schedule
    report = validate(job, scenario, sched)  # the simulator derives the job from its partition
    assert report.iteration_time_ms == pytest.approx(rep.iteration_time_ms)
    assert (sched.partition_ranges() is not None) == rep.repartitioned


def test_reroute_claim_breaks_under_the_wrong_partition() -> None:
    """The hook is real: the same orders replayed on the job's own partition give another time."""
    job = JobSpec.model_validate(
        {"name": "j", "num_pipelines": 2, "num_stages": 2, "num_microbatches": 2,
         "stages": [dict.fromkeys(("forward", "backward_input", "backward_weight"), 2.0)
                    | {"optimizer": 0.1, "activation_mib": 10.0, "weight_grad_mib": 5.0}] * 2,
         "comm": {"activation_ms": 0.0, "cross_pipeline_ms": 0.0, "allreduce_ms": 0.0},
         "model": {"layers": 4}}
    )  # fmt: skip
    scenario = FailureScenario(failed=[(0, 1)])
    rep = plan_repartition(job, scenario, use_cpsat=False)
    assert rep.repartitioned and rep.partition == [[0, 3], [3, 4]]
    sched = rep.result.schedule.model_copy(deep=True)
    assert sched.__pydantic_extra__ is not None
    sched.__pydantic_extra__.pop("partition")
    with pytest.raises(ScheduleRuleError, match="claim"):
        validate(job, scenario, sched)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_bad_maps_are_refused_naming_the_layer_or_stage(data: st.DataObject) -> None:
    job = data.draw(layered_jobs())
    model = layer_model(job)
    part = [list(r) for r in model.partition]
    s = data.draw(st.integers(0, job.num_stages - 2))
    kind = data.draw(st.sampled_from(["overlap", "gap", "empty"]))
    doc = job.model_dump(mode="json")
    if kind == "overlap":
        part[s + 1][0] -= 1
        match = f"partition: layer {part[s + 1][0]} is held by stages {s} and {s + 1}"
    elif kind == "gap":
        if part[s + 1][1] - part[s + 1][0] < 2:
            return
        part[s + 1][0] += 1
        match = f"partition: layer {part[s + 1][0] - 1} is held by no stage"
    else:  # a range ending before it starts; an empty one is a schedule's right (test_partition_empty)
        part[s] = [part[s][0], part[s][0] - 1]
        match = rf"partition: stage {s}: range \[{part[s][0]}, {part[s][1]}\) ends before it starts"
    with pytest.raises(InvalidInputError, match=match):
        derive_job(job, part)
    with pytest.raises(ValueError, match=match):
        JobSpec.model_validate({**doc, "partition": part})


def test_derivation_from_model_shape_is_labelled() -> None:
    job = JobSpec.model_validate_json(Path("examples/gpt3-1.3b-p4d4.json").read_text())
    model = layer_model(job)
    assert model.source == "derived" and model.bandwidth_source == "derived"
    assert model.partition == [[0, 6], [6, 12], [12, 18], [18, 24]]
    assert model.layers[0].param_mib == pytest.approx(12 * 2048**2 * 4 / 2**20)
    with pytest.raises(InvalidInputError, match="layers: re-partition needs per-layer figures"):
        layer_model(JobSpec.model_validate({**job.model_dump(mode="json"), "model": None}))


def _two_stage_job(capacity: list[float]) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "j", "num_pipelines": 2, "num_stages": 2, "num_microbatches": 2,
         "stages": [dict.fromkeys(("forward", "backward_input", "backward_weight"), 2.0)
                    | {"optimizer": 0.1, "activation_mib": 10.0, "weight_grad_mib": 5.0}] * 2,
         "comm": {"activation_ms": 0.0, "cross_pipeline_ms": 0.0, "allreduce_ms": 0.0},
         "model": {"layers": 4, "hidden": 64}, "memory_capacity_mib": capacity}
    )  # fmt: skip


def test_a_schedule_whose_partition_overfills_a_stage_breaks_the_memory_rule() -> None:
    """Its layers' parameters and optimizer state exceed the stage's capacity: the validator says
    INVALID [memory] (exit 4), not bad input (exit 2) as it did."""
    job = JobSpec.model_validate(
        _two_stage_job([100.0, 100.0]).model_dump(mode="json")
        | {"layers": [dict.fromkeys(FIELDS, 1.0) | {"param_mib": 55.0, "optimizer_state_mib": 55.0}] * 4}
    )
    scenario = FailureScenario(failed=[(0, 1)])
    rep = plan_repartition(job, scenario, use_cpsat=False)
    sched = rep.result.schedule.model_copy(deep=True)
    assert sched.__pydantic_extra__ is not None
    sched.__pydantic_extra__["partition"] = [[0, 1], [1, 4]]  # stage 1: 100 + 220 - 330 < 0 MiB left
    with pytest.raises(ScheduleRuleError, match=r"\[memory\] partition: memory_capacity_mib: stage 1"):
        validate(job, scenario, sched)


def test_capacity_no_partition_meets_names_the_stage() -> None:
    job = _two_stage_job([1.0, 1.0])  # no stage can hold one layer's 5 MiB of activations
    with pytest.raises(InvalidInputError, match=r"memory_capacity_mib: stage 0 \(1.0 MiB\) cannot hold"):
        plan_repartition(job, FailureScenario(failed=[(0, 0)]), use_cpsat=False)
    job = _two_stage_job([100.0, 1.0])  # stage 1 cannot: it holds none, stage 0 all four
    rep = plan_repartition(job, FailureScenario(failed=[(0, 0)]), use_cpsat=False)
    assert rep.partition == [[0, 4], [4, 4]] and "does not fit in memory" in rep.note
    validate(job, FailureScenario(failed=[(0, 0)]), rep.result.schedule)


def test_a_split_that_fits_where_the_job_partition_does_not() -> None:
    job = _two_stage_job([100.0, 6.0])  # 2 layers x 5 MiB do not fit stage 1; 1 layer does
    rep = plan_repartition(job, FailureScenario(failed=[(0, 0)]), use_cpsat=False)
    assert rep.reroute is None and rep.partition == [[0, 3], [3, 4]]
    assert "does not fit in memory" in rep.note
    validate(job, FailureScenario(failed=[(0, 0)]), rep.result.schedule)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_migration_estimate_is_what_the_busiest_sender_sends(data: st.DataObject) -> None:
    """Parameters (param_mib without its gradient half) + optimizer state, per pipeline; a live peer
    sends the copies of its stage's failed pipelines too, so a failure at the source multiplies."""
    job = data.draw(layered_jobs())
    model = layer_model(job)
    part = data.draw(compositions(model.num_layers, job.num_stages, empty=True))
    scenario = data.draw(recoverable_scenarios(job))
    mig = migration(job, part, model, scenario=scenario)
    given_by: dict[int, float] = {}
    for mv in mig.moves:
        for layer in model.layers[mv.layers[0] : mv.layers[1]]:
            given_by[mv.from_stage] = given_by.get(mv.from_stage, 0.0) + layer.param_mib / 2 + 12.0
    assert mig.mib == pytest.approx(sum(given_by.values()))
    failed = [s for _, s in scenario.failed]
    busiest = max(((1 + failed.count(f)) * mib for f, mib in given_by.items()), default=0.0)
    assert mig.estimated_ms == pytest.approx(busiest / model.migration_mib_per_ms)
    assert migration(job, part, model).estimated_ms <= mig.estimated_ms + 1e-9
