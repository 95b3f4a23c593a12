"""Review of the empty stage (issue 12 follow-up), planner side:

- a job spec whose own partition leaves a stage no layer (allowed beside given `layers`) keeps that
  stage's optimizer time and all-reduce in the partition search as in the job itself: the search's
  bound of the job's own partition is `load_bound(job)`, and the derived job of any partition keeping
  the stage empty keeps its figures (the search had dropped them: 15.0 ms against 15.5 ms);
- no partition fitting the memory of such a job is not blamed on that stage (it named the empty
  stage, the roomiest, as unable to hold one layer);
- a schedule whose empty range lies past the last layer is refused naming that stage (the layer
  count was read off the empty range's end, and the error named a layer no stage held).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.bounds import load_bound
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import InvalidInputError
from planner.partition import derive_job, layer_model
from planner.partition.choose import plan_repartition
from planner.partition.search import best_partition, partition_bound, stage_costs
from tests.strategies import recoverable_scenarios
from tests.test_partition import FIELDS, compositions, layered_jobs
from tests.test_partition_cli import job_doc

LAYER = {"forward": 0.5, "backward_input": 0.5, "backward_weight": 0.5, "activation_mib": 20.0,
         "weight_grad_mib": 5.0, "param_mib": 10.0, "optimizer_state_mib": 30.0}  # fmt: skip


def test_a_job_spec_with_an_empty_stage_keeps_its_optimizer_and_allreduce() -> None:
    job = JobSpec.model_validate(job_doc(layers=[LAYER] * 6, partition=[[0, 3], [3, 3], [3, 6]]))
    scenario = FailureScenario(failed=[(0, 1)])
    model = layer_model(job)
    costs = stage_costs(job, model, scenario)
    assert partition_bound(costs, model.partition) == pytest.approx(load_bound(job, scenario))
    other = derive_job(job, [[0, 2], [2, 2], [2, 6]], model)  # stage 1 stays empty
    assert other.stages[1].optimizer == job.stages[1].optimizer == 0.2
    assert other.allreduce_ms(1) == job.allreduce_ms(1) == 0.3
    assert partition_bound(costs, [[0, 2], [2, 2], [2, 6]]) == pytest.approx(load_bound(other, scenario))


def test_an_unmeetable_capacity_is_not_blamed_on_a_stage_that_holds_no_layer() -> None:
    caps = [10.0, 400.0, 10.0]  # stages 0 and 2 hold a layer or two, not all six
    doc = job_doc(layers=[LAYER] * 6, partition=[[0, 3], [3, 3], [3, 6]], memory_capacity_mib=caps)
    with pytest.raises(InvalidInputError, match=r"^memory_capacity_mib: no partition fits every stage"):
        plan_repartition(JobSpec.model_validate(doc), FailureScenario(failed=[(0, 1)]), use_cpsat=False)


@st.composite
def jobs_with_an_empty_stage(draw: st.DrawFn) -> JobSpec:
    """A layered job re-split so that some stage may hold no layer; each stage's optimizer time is
    0.2 ms plus 0.1 ms per layer (so an empty one has some)."""
    doc: dict[str, Any] = draw(layered_jobs()).model_dump(mode="json")
    layers, num_stages = doc["layers"], doc["num_stages"]
    part = draw(compositions(len(layers), num_stages, empty=True))
    stages = []
    for a, b in part:
        fig = {f: sum(x[f] for x in layers[a:b]) + draw(st.sampled_from([0.0, 0.5])) for f in FIELDS}
        stages.append({**fig, "optimizer": round(0.2 + 0.1 * (b - a), 3)})
    return JobSpec.model_validate({**doc, "stages": stages, "partition": part, "memory_capacity_mib": None})


@pytest.mark.timeout(60)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_search_bound_is_the_load_bound_of_the_derived_job(data: st.DataObject) -> None:
    job = data.draw(jobs_with_an_empty_stage())
    scenario = data.draw(recoverable_scenarios(job, max_failures=2, slow=False))
    model = layer_model(job)
    costs = stage_costs(job, model, scenario)
    assert partition_bound(costs, model.partition) == pytest.approx(load_bound(job, scenario))
    best, found = best_partition(costs)
    assert found is not None
    assert load_bound(derive_job(job, found, model), scenario) == pytest.approx(best)


def test_a_schedule_range_past_the_last_layer_names_its_stage() -> None:
    doc = {"job": "tiny", "iteration_time_ms": 1.0, "workers": [], "partition": [[0, 3], [7, 7], [3, 6]]}
    with pytest.raises(ValueError, match=r"partition: stage 1: empty range \[7, 7\) is outside 0..6"):
        Schedule.model_validate(doc)
    doc["partition"] = [[0, 6], [6, 6], [6, 6]]
    assert Schedule.model_validate(doc).partition_ranges() == [[0, 6], [6, 6], [6, 6]]
