"""runtime_adapter.profile_layers: a measured per-layer profile the planner re-partitions with."""

from __future__ import annotations

import pytest

from planner.contract import FailureScenario, JobSpec
from planner.partition import layer_model
from planner.partition.choose import plan_repartition
from runtime_adapter.model import GPTConfig, gpt_training
from runtime_adapter.profile import profile_stages
from runtime_adapter.profile_comm import CommMeasurement, job_spec_from_profile
from runtime_adapter.profile_layers import profile_layers, with_layers

CFG = GPTConfig(hidden=32, num_layers=4, seq_len=16, microbatch_size=2)


@pytest.mark.timeout(90)
def test_measured_layers_plan_a_repartition() -> None:
    training = gpt_training(CFG)
    layers = profile_layers(training, 2, 2, repeats=2, warmup=1)
    assert len(layers) == 4
    assert all(x["forward"] > 0 and x["param_mib"] > 0 and x["optimizer_state_mib"] > 0 for x in layers)
    stages = profile_stages(training, 2, 2, 2, repeats=2, warmup=1)
    comm = CommMeasurement(activation_ms=0.01, allreduce_ms=[0.1, 0.1])
    doc = job_spec_from_profile("gpt", stages, comm, 2, 2, 1000.0).model_dump(mode="json")
    job = JobSpec.model_validate(with_layers(doc, training, layers))
    model = layer_model(job)
    assert model.source == "given" and model.partition == [[0, 2], [2, 4]]
    rep = plan_repartition(job, FailureScenario(failed=[(0, 1)]), use_cpsat=False)
    assert rep.best_load_bound_ms <= rep.reroute_load_bound_ms
    with pytest.raises(ValueError, match="layer_ranges"):
        profile_layers(training.__class__(**{**training.__dict__, "layer_ranges": None}))
