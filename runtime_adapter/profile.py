"""Profiler: measure each stage of a Training (the reference GPT by default) on this machine.

Every op is timed exactly as the executor runs it: F through `StageRunner.forward` (the last stage
scales its loss by 1/(D*M)), B and W through `autograd_split` (at stage 0 B is empty and W runs the
whole backward, as in the executor), BW as one `torch.autograd.backward`, and OPT's local work by the
executor's own `_opt` on a one-rank group (flatten the gradients, keep the pre-step snapshot, step).
Times are medians over `repeats` after `warmup` rounds: wall clock on CPU (with
`torch.set_num_threads(threads)`; workers run with OMP_NUM_THREADS=1), CUDA events on a GPU. Memory is
what autograd saves for backward, counted once per storage and without the parameters; on a GPU the
caching allocator's `memory_allocated` deltas. profile_comm.py measures the hops and all-reduces.
"""

from __future__ import annotations

import statistics
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from runtime_adapter.autograd_split import stage_backward_input, stage_backward_weight
from runtime_adapter.comm import Groups, Waiter
from runtime_adapter.executor import Executor
from runtime_adapter.stage import StageRunner, infer_shapes
from runtime_adapter.timing import Timer
from runtime_adapter.training import Training

MIB = float(1 << 20)
Progress = Callable[[str], None]
GLOO_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class StageMeasurement:
    """Measured costs of one stage for one micro-batch: times in ms, memory in MiB."""

    stage: int
    num_params: int
    forward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    backward_fused_ms: float
    optimizer_ms: float
    activation_mib: float
    weight_grad_mib: float


def _storages(tensors: list[torch.Tensor], exclude: set[int]) -> float:
    """MiB of the distinct storages behind `tensors`, leaving out those in `exclude` (parameters)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values()) / MIB


class _StageBench:
    """One stage module with the executor's calling conventions and one micro-batch of input."""

    def __init__(self, runner: StageRunner, module: torch.nn.Module, scale: float) -> None:
        self.runner, self.module, self.scale = runner, module, scale
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.inputs, self.targets = runner.read(0, 0, 0)
        gen = torch.Generator().manual_seed(runner.training.seed)

        def boundary(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.randn(shape, generator=gen).to(runner.device, runner.training.boundary_dtype)

        self.act = None if runner.is_first else boundary(runner.input_shape)
        self.grad = None if runner.is_last else boundary(runner.output_shape)
        self.fixed = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.fixed |= {b.untyped_storage().data_ptr() for b in module.buffers()}

    def forward(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(stage input or None at stage 0, output or scaled loss), as executor F."""
        r = self.runner
        inp = None if self.act is None else self.act.clone().requires_grad_()
        x = self.inputs if inp is None else inp
        assert x is not None
        out = r.forward(self.module, 0, (0, 0), x, self.targets)
        return inp, (out * self.scale if r.is_last else out)

    def out_grad(self) -> list[torch.Tensor] | None:
        return None if self.grad is None else [self.grad]

    def backward_input(self, inp: torch.Tensor | None, out: torch.Tensor) -> list[dict[str, Any]]:
        """Executor B: input gradient only (nothing at stage 0); the groups W needs."""
        if inp is None:
            return []
        _, groups = stage_backward_input([out], self.out_grad(), [inp], iter(self.params))
        return groups

    def backward_weight(self, out: torch.Tensor, groups: list[dict[str, Any]]) -> None:
        """Executor W: weight gradient from B's intermediates (the whole backward at stage 0)."""
        if self.runner.is_first:
            torch.autograd.backward([out], self.out_grad())
        else:
            stage_backward_weight(iter(self.params), groups)

    def backward_fused(self, out: torch.Tensor) -> None:
        torch.autograd.backward([out], self.out_grad())

    def memory(self) -> tuple[float, float]:
        """(activation MiB held from F to B, MiB still held from the end of B to the end of W)."""
        if self.runner.device.type == "cuda":
            return self.cuda_memory()
        saved: list[weakref.ref[torch.Tensor]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(weakref.ref(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inp, out = self.forward()
        alive = [t for t in (r() for r in saved) if t is not None]
        held = [*alive, out] + ([inp] if inp is not None else [])
        activation = _storages(held, self.fixed)
        if self.runner.is_first:
            weight_grad = activation  # B is empty: everything stays until W
            self.backward_weight(out, [])
        else:
            groups = self.backward_input(inp, out)
            del held, alive
            kept = [
                out,
                *(t for t in (r() for r in saved) if t is not None),
            ]  # the executor keeps out until W
            kept += [g for pg in groups for gs in pg.get("grads") or [] for g in gs if g is not None]
            weight_grad = _storages(kept, self.fixed)
            self.backward_weight(out, groups)
        self.module.zero_grad(set_to_none=True)
        return activation, weight_grad

    def cuda_memory(self) -> tuple[float, float]:
        """memory() from the CUDA caching allocator: bytes allocated after F and after B (parameters'
        gradients from a previous round are freed first; W's own gradients are not activations)."""
        self.module.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.runner.device)
        base = torch.cuda.memory_allocated(self.runner.device)
        inp, out = self.forward()
        activation = (torch.cuda.memory_allocated(self.runner.device) - base) / MIB
        groups = [] if self.runner.is_first else self.backward_input(inp, out)
        del inp
        weight_grad = (
            activation
            if self.runner.is_first
            else (torch.cuda.memory_allocated(self.runner.device) - base) / MIB
        )
        self.backward_weight(out, groups)
        self.module.zero_grad(set_to_none=True)
        return activation, weight_grad


def _one_rank_groups() -> Groups:
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, GLOO_TIMEOUT)
    return Groups(0, pg, {(0, 0): 0}, pg, {(0, 0): 0}, Waiter(threading.Event()))


def _measure_stage(
    runner: StageRunner, num_pipelines: int, num_microbatches: int, warmup: int, repeats: int
) -> StageMeasurement:
    total = num_pipelines * num_microbatches
    module = runner.build()
    bench = _StageBench(runner, module, 1.0 / total)
    ex = Executor(module, runner, (0, runner.stage), num_pipelines, num_microbatches)
    ex.groups = _one_rank_groups()
    timer = Timer(runner.device)
    times: dict[str, list[float]] = {"F": [], "B": [], "W": [], "BW": [], "OPT": []}
    for r in range(warmup + repeats):
        f_ms, (inp, out) = timer.time(bench.forward)
        b_ms, groups = timer.time(lambda: bench.backward_input(inp, out))  # noqa: B023
        w_ms, _ = timer.time(lambda: bench.backward_weight(out, groups))  # noqa: B023
        _, (_, out2) = timer.time(bench.forward)
        bw_ms, _ = timer.time(lambda: bench.backward_fused(out2))  # noqa: B023
        opt_ms, _ = timer.time(lambda: ex._opt(r, torch.ones(total), []))  # noqa: B023
        ex.optimizer.zero_grad(set_to_none=True)
        if r >= warmup:
            for k, v in zip(
                times, (f_ms, 0.0 if runner.is_first else b_ms, w_ms, bw_ms, opt_ms), strict=True
            ):
                times[k].append(v)
    ex.groups.waiter.close()
    activation, weight_grad = bench.memory()
    med = {k: statistics.median(v) for k, v in times.items()}
    return StageMeasurement(
        stage=runner.stage,
        num_params=sum(p.numel() for p in bench.params),
        forward_ms=med["F"],
        backward_input_ms=med["B"],
        backward_weight_ms=med["W"],
        backward_fused_ms=med["BW"],
        optimizer_ms=med["OPT"],
        activation_mib=activation,
        weight_grad_mib=weight_grad,
    )


def profile_stages(
    training: Training,
    num_stages: int,
    num_pipelines: int = 1,
    num_microbatches: int = 1,
    repeats: int = 5,
    warmup: int = 2,
    threads: int = 1,
    progress: Progress | None = None,
    device: torch.device | None = None,
) -> list[StageMeasurement]:
    """Measure F, B, W, BW, OPT (ms) and activation / weight-gradient memory (MiB) of every stage.

    D and M only set the loss scale and the executor's count vector, as in a real run.
    """
    if repeats < 1 or warmup < 0 or threads < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0, threads >= 1 (got {repeats}, {warmup}, {threads})")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = []
        shapes = infer_shapes(training, num_stages)
        for s in range(num_stages):
            if progress:
                progress(f"profiling stage {s}/{num_stages - 1} ({repeats} repeats)")
            runner = StageRunner(training, s, num_stages, device or torch.device("cpu"), shapes)
            out.append(_measure_stage(runner, num_pipelines, num_microbatches, warmup, repeats))
        return out
    finally:
        torch.set_num_threads(old)
