"""The public API (runtime_adapter/training.py): entry points and their errors, the checks made before
any process starts, the per-micro-batch random streams, clipping, and a real run with dropout, AdamW,
global-norm clipping and a warm-up where a worker is killed with SIGKILL: parameters equal
single-process training's."""

from __future__ import annotations

import functools
import itertools
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from planner.errors import InvalidInputError
from runtime_adapter.cli import main as runtime_main
from runtime_adapter.comm import build_groups
from runtime_adapter.entry import load_entry
from runtime_adapter.executor import Executor
from runtime_adapter.launch import Launcher, LaunchSpec, WorkerStartupError
from runtime_adapter.model import GPTConfig, gpt_training
from runtime_adapter.reference import relative_error, train_reference
from runtime_adapter.stage import (
    NondeterministicDataError,
    StageRunner,
    UserCodeError,
    check_training,
    infer_shapes,
)
from runtime_adapter.training import (
    GradClip,
    clip_gradients,
    microbatch_seed,
    split_bounds,
    stages_from_layers,
)
from tests.jobs import tiny_job
from tests.test_runtime_process import planner_schedules, records
from tests.test_runtime_worker import one_worker

pytestmark = pytest.mark.timeout(300)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("entry", "kwargs", "says"),
    [
        ("no_colon", {}, "expected package.module:function"),
        ("no_such_module_here:training", {}, "cannot import no_such_module_here"),
        ("runtime_adapter.model:nope", {}, "has no function nope"),
        ("tests.library_entries:not_training", {}, "returned int"),
        ("tests.library_entries:broken", {}, "RuntimeError: the user's entry is broken"),
        ("runtime_adapter.model:training", {"hiden": 3}, "hiden"),
        ("runtime_adapter.model:training", {"optimizer": "lamb"}, "optimizer must be"),
        ("runtime_adapter.model:training", {"lr": float("nan")}, "lr must be a positive finite number"),
        ("runtime_adapter.model:training", {"lr": 1e308}, "lr must be a positive finite number"),
        ("runtime_adapter.model:training", {"exact_sums": "no"}, "exact_sums must be true or false"),
    ],
)
def test_entry_errors_are_one_line(entry: str, kwargs: dict, says: str) -> None:
    with pytest.raises(InvalidInputError) as e:
        load_entry(entry, kwargs)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_checks_before_start() -> None:
    with pytest.raises(InvalidInputError, match="cannot be split into 3 stages"):
        check_training(gpt_training(GPTConfig(num_layers=2)), 3, 1, 1)
    with pytest.raises(NondeterministicDataError, match="pure function"):
        check_training(load_entry("tests.library_entries:nondeterministic", {}), 2, 2, 2)
    # the shapes: given by the reference GPT, inferred on meta otherwise (the same)
    training = gpt_training(GPTConfig(hidden=16, num_heads=2, seq_len=8, microbatch_size=3))
    inferred = infer_shapes(training.__class__(**{**training.__dict__, "activation_shape": None}), 4)
    assert check_training(training, 4, 2, 2) == inferred == [(3, 8, 16)] * 3
    # a stage whose forward replaces a non-persistent buffer (a cache): taken; a state_dict one: refused
    check_training(load_entry("tests.library_entries:forward_cache", {}), 2, 1, 1)
    for num_stages in (2, 1):  # a stage before the last (shape inference), the last (loss check)
        with pytest.raises(InvalidInputError, match="stage 0's forward changes its buffer 'seen'"):
            check_training(load_entry("tests.library_entries:step_counter", {}), num_stages, 1, 1)
    # a given shape that is not what the stages return: refused before start (not at the first send)
    wrong = training.__class__(**{**training.__dict__, "activation_shape": (3, 16, 16)})
    with pytest.raises(InvalidInputError, match=r"activation_shape is \[3, 16, 16\], but stage 0 returns"):
        check_training(wrong, 4, 2, 2)
    # a loss that is not one element (reduction="none"): refused before start, on the meta device
    meta = training.__class__(**{**training.__dict__, "activation_shape": None})
    per_sample = meta.__class__(**{**meta.__dict__, "loss": lambda o, t: meta.loss(o, t).expand(3)})
    with pytest.raises(UserCodeError, match=r"returned a torch.float32 tensor of shape \[3\]"):
        check_training(per_sample, 4, 2, 2)
    # stage() split otherwise than layer_ranges.home(P): the profile measured one, the job spec said the other
    from tests.test_runtime_empty_stage import layer_list_training

    def plain_layers() -> list[torch.nn.Module]:
        return [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)]

    plain = layer_list_training()
    resplit = plain.__class__(**{**plain.__dict__, "stage": stages_from_layers(plain_layers, [1, 2])})
    check_training(plain, 3, 1, 1)
    with pytest.raises(InvalidInputError, match=r"stage 0 of 3: stage\(\) builds 2 parameter tensors"):
        check_training(resplit, 3, 1, 1)

    def tied_layers() -> list[torch.nn.Module]:  # the first and last layer share their weight
        layers = plain_layers()
        layers[-1][0].weight = layers[0][0].weight
        return layers

    fields = {**plain.__dict__, "stage": stages_from_layers(tied_layers), "layer_ranges": None}
    tied = plain.__class__(**fields)
    with pytest.raises(InvalidInputError, match="layers 0 and 3 share a parameter"):
        check_training(tied, 3, 1, 1)
    check_training(tied, 1, 1, 1)  # on one stage the tie is one tensor: nothing to refuse


@given(st.integers(1, 40), st.integers(1, 12))
def test_split_bounds_fill_every_stage(num_layers: int, num_stages: int) -> None:
    if num_layers < num_stages:
        with pytest.raises(ValueError, match="cannot be split"):
            split_bounds(num_layers, num_stages)
        return
    bounds = split_bounds(num_layers, num_stages)
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    assert bounds[0] == 0 and bounds[-1] == num_layers and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert split_bounds(num_layers, num_stages, bounds[1:-1]) == bounds
    if num_stages > 1:
        with pytest.raises(ValueError, match="increasing layer indices"):
            split_bounds(num_layers, num_stages, [*bounds[1:-1][:-1], 0])


def test_dropout_draws_the_same_numbers_wherever_a_microbatch_runs() -> None:
    training = gpt_training(GPTConfig(dropout=0.5, num_layers=2))
    shapes = infer_shapes(training, 2)
    runners = [StageRunner(training, 1, 2, CPU, shapes) for _ in range(2)]
    modules = [r.build() for r in runners]
    x = torch.randn(shapes[0])
    _, targets = runners[0].read(3, 1, 0)
    torch.manual_seed(1)  # a different global state on each "host" before the forward
    a = runners[0].forward(modules[0], 3, (1, 0), x, targets)
    torch.manual_seed(2)
    b = runners[1].forward(modules[1], 3, (1, 0), x, targets)
    c = runners[1].forward(modules[1], 3, (1, 1), x, targets)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert microbatch_seed(0, 3, 1, 0, 1) != microbatch_seed(0, 3, 1, 0, 0)


def test_global_clipping_equals_clip_grad_norm_over_the_whole_model() -> None:
    torch.manual_seed(0)
    stages = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)]
    x = torch.randn(5, 4)
    stages[1](stages[0](x)).pow(2).sum().backward()
    whole = [p.grad.clone() for st in stages for p in st.parameters()]  # type: ignore[union-attr]
    params = [list(st.parameters()) for st in stages]
    norms = [torch.zeros(2, dtype=torch.float64) for _ in stages]

    def exchange_for(s: int):  # the world all-reduce (MAX): every stage contributes at its index
        def exchange(v: torch.Tensor) -> torch.Tensor:
            norms[s] = v
            return torch.stack([norms[0], norms[1]]).max(dim=0).values

        return exchange

    # every stage's squared norm must be known before any clips: contribute first, then clip
    from runtime_adapter.training import squared_norm

    norms[0][0], norms[1][1] = squared_norm(params[0]), squared_norm(params[1])
    got = [clip_gradients(params[s], GradClip(0.1, "global"), s, 2, exchange_for(s)) for s in range(2)]
    expected_params = [torch.nn.Parameter(g.clone()) for g in whole]
    for p, g in zip(expected_params, whole, strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(expected_params, 0.1)
    assert got[0] == got[1] == pytest.approx(float(norm), rel=1e-6)
    flat = [p.grad for st in stages for p in st.parameters()]
    for a, b in zip(flat, [p.grad for p in expected_params], strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)  # type: ignore[arg-type]


def test_rollback_restores_adamw_clipping_and_the_lr_schedule_exactly() -> None:
    """Replaying a rolled-back iteration gives the same parameters to the bit: the snapshot covers the
    AdamW moments and step count, and the learning rate is a function of the iteration."""
    import torch.distributed as dist

    training = load_entry("runtime_adapter.model:training", {**MODEL, "clip_scope": "stage", "warmup": 5})
    runner = StageRunner(training, 0, 1, CPU, [])
    ex = Executor(runner.build(), runner, (0, 0), 1, 4)
    a = one_worker()
    ex.apply(a, build_groups(dist.HashStore(), a, threading.Event(), "gloo", timedelta(seconds=10)))
    for it in range(3):
        ex.run_iteration(it)
    first = {k: v.clone() for k, v in ex.module.state_dict().items()}
    ex.rollback_to(2)
    assert ex.stepped == 2 and not all(torch.equal(v, first[k]) for k, v in ex.module.state_dict().items())
    ex.run_iteration(2)
    assert all(torch.equal(v, first[k]) for k, v in ex.module.state_dict().items())
    assert ex.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 3 / 5)  # iteration 2 of a 5 warm-up


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--entry", "no_such_module_here:training"], "cannot import"),
        (["--entry", "tests.library_entries:nondeterministic"], "pure function"),
        (["--entry", "tests.library_entries:batch_norm"], "running statistics"),
        (["--entry", "tests.library_entries:step_counter"], "stage 0's forward changes its buffer 'seen'"),
        (["--entry", "tests.library_entries:varying_shapes"], "every micro-batch must have the same shapes"),
        (["--entry", "tests.library_entries:one_tensor"], "must return (inputs, targets), two tensors"),
        (["--entry", "tests.library_entries:bad_optimizer"], "Invalid learning rate"),
        (["--device", "tpu"], "unknown device"),
        (
            ["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "cuda:99"],
            "--device cuda",
        ),
        (["--model", '{"num_layers": 1}'], "cannot be split into 2 stages"),
    ],
)
def test_launch_refuses_bad_training_before_starting(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.json"
    job.write_text(tiny_job(2, 2).model_dump_json())
    out = tmp_path / "out"
    argv = ["launch", "--job", str(job), "--schedules", str(tmp_path), "--out", str(out), *flags]
    assert runtime_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert not out.exists()  # nothing started, nothing written


MODEL = {"dropout": 0.1, "optimizer": "adamw", "clip": 0.05, "clip_scope": "global", "warmup": 3}
TOL = 1e-6  # gradients are summed in float64 (grad_sum.py): in practice the parameters are bitwise equal


@functools.lru_cache(maxsize=2)
def reference(num_iterations: int) -> list[dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_reference(load_entry("runtime_adapter.model:training", MODEL), 2, 2, 4, num_iterations)
    finally:
        torch.set_num_threads(threads)


def test_sigkill_and_rejoin_with_dropout_adamw_and_global_clipping_equal_single_process(
    tmp_path: Path,
) -> None:
    """kill -9 of [1, 1] before a W of iteration 2; a warm standby re-joins (AdamW moments copied
    from its peer). Every worker, the re-joiner too, ends with single-process training's parameters."""
    job, n, victim = tiny_job(2, 2), 6, (1, 1)
    spec = LaunchSpec(job, MODEL, n, tmp_path, fail_at={victim: (2, "W")})
    launcher = Launcher(spec, planner_schedules(job))  # type: ignore[arg-type]
    launcher.start()
    launcher.add_standby(victim)

    def on_tick(lr: Launcher) -> None:
        if victim in lr.failed and lr.standbys.get(victim):
            lr.activate(victim)

    codes = launcher.wait(timedelta(seconds=240), on_tick)
    assert all(rc == 0 for rc in codes.values()), codes
    assert [r for r in records(tmp_path, victim) if r["event"] == "rejoin"], "the standby never re-joined"
    ref = reference(n)
    for d, s in [(0, 0), (1, 0), (0, 1), victim]:
        got = torch.load(tmp_path / f"final_{d}_{s}.pt")
        err = relative_error(got, ref[s])
        print(f"worker [{d}, {s}]: relative error {err:.2e}")
        assert err < TOL, f"worker [{d}, {s}]: relative error {err:.2e} vs single-process training"


def test_float32_sums_stay_within_float32_noise_of_single_process(tmp_path: Path) -> None:
    """exact_sums=False (autograd's float32 accumulation, float32 all-reduce): SGD's parameters agree
    with single-process training to float32 rounding, not to the bit; the float32 path really ran."""
    job, n, model = tiny_job(2, 2), 3, {"exact_sums": False}
    launcher = Launcher(LaunchSpec(job, model, n, tmp_path), planner_schedules(job))  # type: ignore[arg-type]
    launcher.start()
    assert all(rc == 0 for rc in launcher.wait(timedelta(seconds=240)).values())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_reference(load_entry("runtime_adapter.model:training", model), 2, 2, 4, n)
    finally:
        torch.set_num_threads(threads)
    errors = [
        relative_error(torch.load(tmp_path / f"final_{d}_{s}.pt"), ref[s]) for d in (0, 1) for s in (0, 1)
    ]
    assert max(errors) < 1e-5, errors


def test_a_data_function_that_differs_between_processes_stops_the_launch(tmp_path: Path) -> None:
    """Before: each process read its own data and every start-up check passed (they run in one
    process), so re-routed micro-batches trained on other data than their own pipeline's."""
    job = tiny_job(2, 2)
    spec = LaunchSpec(job, {}, 3, tmp_path, entry="tests.library_entries:per_process")
    launcher = Launcher(spec, planner_schedules(job))  # type: ignore[arg-type]
    launcher.start()
    with pytest.raises(WorkerStartupError, match="data functions disagree") as got:
        launcher.wait(timedelta(seconds=120))
    assert got.value.code == 2
    assert not any(r["event"] == "step" for w in spec.workers() for r in records(tmp_path, w))
