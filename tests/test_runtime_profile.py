"""Profiler: measured fields are sane, the job spec validates and the planner accepts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.contract import FailureScenario, JobSpec
from planner.partition import layer_model
from planner.plan import plan
from runtime_adapter.cli import main as runtime_main
from runtime_adapter.model import GPTConfig, gpt_training
from runtime_adapter.profile import StageMeasurement, profile_stages
from runtime_adapter.profile_comm import (
    CommMeasurement,
    job_spec_from_profile,
    measure_allreduce_ms,
    measure_hop_ms,
)

pytestmark = pytest.mark.timeout(60)

CFG = GPTConfig(hidden=32, num_layers=2, seq_len=16, microbatch_size=2)


@pytest.fixture(scope="module")
def measured() -> list[StageMeasurement]:
    return profile_stages(gpt_training(CFG), 2, num_pipelines=2, num_microbatches=2, repeats=3, warmup=1)


def test_fields_positive(measured: list[StageMeasurement]) -> None:
    assert [st.stage for st in measured] == [0, 1]
    for st in measured:
        for v in (st.forward_ms, st.backward_weight_ms, st.backward_fused_ms, st.optimizer_ms):
            assert v > 0, st
        assert st.activation_mib > 0 and st.weight_grad_mib > 0 and st.num_params > 0, st
    # stage 0 has no input gradient: B is empty and W is the whole backward (as the executor runs it)
    assert measured[0].backward_input_ms == 0.0
    assert measured[0].weight_grad_mib == measured[0].activation_mib
    assert measured[1].backward_input_ms > 0


def test_split_backward_close_to_fused() -> None:
    """B + W does the work of BW once (W reuses B's intermediates), so they are close when compute
    dominates (on a tiny model the Python graph walk of the split backward dominates instead)."""
    cfg = GPTConfig(hidden=128, num_heads=4, num_layers=2, seq_len=32, microbatch_size=2)
    for st in profile_stages(gpt_training(cfg), 2, repeats=5, warmup=1):
        ratio = (st.backward_input_ms + st.backward_weight_ms) / st.backward_fused_ms
        assert 0.3 < ratio < 4.0, f"stage {st.stage}: B+W / BW = {ratio:.2f}"


def test_activation_memory_scales_with_microbatch_size() -> None:
    one = profile_stages(
        gpt_training(GPTConfig(hidden=32, num_layers=2, microbatch_size=1)), 2, repeats=1, warmup=0
    )
    four = profile_stages(
        gpt_training(GPTConfig(hidden=32, num_layers=2, microbatch_size=4)), 2, repeats=1, warmup=0
    )
    for a, b in zip(one, four, strict=True):
        assert 3.0 < b.activation_mib / a.activation_mib < 4.5, (a, b)


def test_comm_measurements_positive() -> None:
    assert measure_hop_ms((CFG.microbatch_size, CFG.seq_len, CFG.hidden), repeats=3, warmup=1) > 0
    assert measure_allreduce_ms(1000, 2, repeats=2, warmup=1) > 0


def test_job_spec_validates_and_plans(measured: list[StageMeasurement]) -> None:
    comm = CommMeasurement(activation_ms=0.1, allreduce_ms=[0.5, 0.6])
    job = job_spec_from_profile("prof", measured, comm, 2, 2, 512.0)
    again = JobSpec.model_validate_json(job.model_dump_json())
    assert again.num_stages == 2 and again.comm.cross_pipeline_ms == 0.1
    assert again.stages[1].forward == measured[1].forward_ms
    result = plan(again, FailureScenario(failed=[(1, 1)]), use_cpsat=False)
    assert result.iteration_time_ms > 0


def test_cli_writes_a_spec_the_planner_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job.json"
    model = json.dumps({"hidden": 16, "num_layers": 2, "seq_len": 8})
    argv = ["profile", "--model", model, "--stages", "2", "--pipelines", "2", "--microbatches", "2"]
    rc = runtime_main([*argv, "--repeats", "1", "--memory-gib", "0.5", "-o", str(out), "--name", "t"])
    assert rc == 0
    assert "stage" in capsys.readouterr().out
    job = JobSpec.model_validate_json(out.read_text())
    assert job.name == "t" and job.memory_capacity_mib == 512.0 and len(job.stages) == 2
    assert plan(job, FailureScenario(), use_cpsat=False).iteration_time_ms > 0


def test_cli_layers_writes_layers_and_partition(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job.json"
    model = json.dumps({"hidden": 16, "num_layers": 4, "seq_len": 8})
    argv = ["profile", "--model", model, "--stages", "2", "--pipelines", "2", "--microbatches", "2"]
    assert runtime_main([*argv, "--layers", "--repeats", "1", "--memory-gib", "0.5", "-o", str(out)]) == 0
    assert "4 layers measured; partition [[0, 2], [2, 4]]" in capsys.readouterr().out
    job = JobSpec.model_validate_json(out.read_text())
    layers = job.layer_profiles()
    assert job.partition_ranges() == [[0, 2], [2, 4]]
    assert layers is not None and len(layers) == 4 and all(x.param_mib > 0 for x in layers)
    extras = layer_model(job).extras  # the embedding / head: stage total - its layers, none negative
    for stage, (a, b), ex in zip(job.stages, [[0, 2], [2, 4]], extras, strict=True):
        assert ex["forward"] > 0
        for f in ("forward", "backward_input", "backward_weight", "activation_mib", "weight_grad_mib"):
            assert sum(getattr(x, f) for x in layers[a:b]) + ex[f] == pytest.approx(getattr(stage, f))
            assert ex[f] >= -1e-9


@pytest.mark.parametrize(
    "extra",
    [
        ["--stages", "2", "--layers", "--entry", "tests.library_entries:no_layer_ranges"],
        ["--stages", "5"],  # more stages than the default model's 4 layers
        ["--stages", "0"],
        ["--stages", "2", "--microbatches", "0"],
        ["--stages", "2", "--memory-gib", "-1"],
        ["--stages", "2", "--model", '{"hiden": 3}'],
        ["--stages", "2", "--model", "not json"],
        ["--stages", "2", "--entry", "no_such_module:training"],
        ["--stages", "2", "--device", "tpu"],
    ],
)
def test_cli_bad_input_exits_2(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert runtime_main(["profile", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
