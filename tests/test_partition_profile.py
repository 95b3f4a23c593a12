"""runtime_adapter.profile_layers: a measured per-layer profile the planner re-partitions with; the
embedding and head are the first and last stage's extras, the layers the blocks alone."""

from __future__ import annotations

import pytest

from planner.contract import FailureScenario, JobSpec
from planner.partition import derive_job, layer_model
from planner.partition.choose import plan_repartition
from planner.partition.layers import LAYER_FIELDS
from runtime_adapter.model import GPTConfig, gpt_training
from runtime_adapter.profile import profile_stages
from runtime_adapter.profile_comm import CommMeasurement, job_spec_from_profile
from runtime_adapter.profile_layers import SCALED, profile_layers, with_layers
from runtime_adapter.training import Training
from tests.test_runtime_empty_stage import layer_list_training

CFG = GPTConfig(hidden=32, num_layers=4, seq_len=16, microbatch_size=2, vocab_size=512)


def job_of(training: Training, P: int) -> dict[str, object]:
    stages = profile_stages(training, P, 2, 2, repeats=2, warmup=1)
    comm = CommMeasurement(activation_ms=0.01, allreduce_ms=[0.1] * P)
    return job_spec_from_profile("m", stages, comm, 2, 2, 1000.0).model_dump(mode="json")


@pytest.mark.timeout(120)
def test_measured_layers_keep_the_embedding_and_head_on_their_stages() -> None:
    training = gpt_training(CFG)
    measured = profile_layers(training, 2, 2, repeats=2, warmup=1)
    assert len(measured) == 4
    layers = measured.layers
    assert all(x["forward"] > 0 and x["param_mib"] > 0 and x["optimizer_state_mib"] > 0 for x in layers)
    # the blocks alone: every layer holds the same parameters (layer 0 no embedding, layer 3 no head)
    assert len({(x["param_mib"], x["optimizer_state_mib"]) for x in layers}) == 1
    assert measured.first["forward"] > 0 and measured.last["forward"] > 0  # embedding, head + loss
    assert measured.first["backward_input"] == 0  # the first stage's B is empty, as in the executor

    doc = job_of(training, 2)
    job = JobSpec.model_validate(with_layers(doc, training, measured))
    model = layer_model(job)
    assert model.source == "given" and model.partition == [[0, 2], [2, 4]]
    for s, (a, b) in enumerate(model.partition):  # the round trip: extras = stage - its layers
        for f in LAYER_FIELDS:
            total = sum(getattr(x, f) for x in model.layers[a:b]) + model.extras[s][f]
            assert total == pytest.approx(getattr(job.stages[s], f), rel=1e-9, abs=1e-12)
            assert model.extras[s][f] >= -1e-9
    # the measured embedding / head, scaled like their stage's layers, are the ends' extras
    for s, end in ((0, measured.first), (1, measured.last)):
        a, b = model.partition[s]
        f = "forward"
        raw = sum(x[f] for x in layers[a:b]) + end[f]
        assert model.extras[s][f] == pytest.approx(job.stages[s].forward * end[f] / raw, rel=1e-6)
        assert model.extras[s][f] > 0
    # an emptied first / last stage keeps its lump: F/B/W = its extras, the layers go to the other
    for part, s in (([[0, 0], [0, 4]], 0), ([[0, 4], [4, 4]], 1)):
        derived = derive_job(job, part, model)
        for f in ("forward", "backward_input", "backward_weight"):
            assert getattr(derived.stages[s], f) == pytest.approx(max(0.0, model.extras[s][f]), abs=1e-9)
        assert derived.stages[s].forward > 0
    rep = plan_repartition(job, FailureScenario(failed=[(0, 1)]), use_cpsat=False)
    assert rep.best_load_bound_ms <= rep.reroute_load_bound_ms
    with pytest.raises(ValueError, match="layer_ranges"):
        profile_layers(training.__class__(**{**training.__dict__, "layer_ranges": None}))


@pytest.mark.timeout(60)
def test_a_model_of_plain_layers_has_no_extras() -> None:
    """No embedding or head: the ends are not measured (their empty stages would be the identity)
    and every stage's figure is its layers'."""

    training = layer_list_training()
    measured = profile_layers(training, 1, 1, repeats=1, warmup=0)
    assert len(measured) == 4 and all(measured.first[f] == measured.last[f] == 0 for f in SCALED)
    job = JobSpec.model_validate(with_layers(job_of(training, 2), training, measured))
    model = layer_model(job)
    for ex in model.extras:
        assert all(v == pytest.approx(0.0, abs=1e-9) for v in ex.values())


@pytest.mark.timeout(60)
def test_a_layer_without_parameters_is_measured() -> None:
    """[Linear, ReLU, Linear]: the ReLU's optimizer raised "optimizer got an empty parameter list" and
    `recycle profile --layers` ended in a traceback (outside review, session 14)."""
    import dataclasses

    import torch

    from runtime_adapter.training import layer_ranges_from_layers, stages_from_layers

    def layers() -> list[torch.nn.Module]:
        torch.manual_seed(3)
        return [torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)]

    training = dataclasses.replace(
        layer_list_training(), stage=stages_from_layers(layers), layer_ranges=layer_ranges_from_layers(layers)
    )
    measured = profile_layers(training, 1, 1, repeats=1, warmup=0)
    assert len(measured) == 3
    relu = measured.layers[1]
    assert relu["param_mib"] == 0 and relu["optimizer_state_mib"] == 0, relu
