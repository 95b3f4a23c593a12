"""Profiler: measure each stage of the reference model on this machine and write a job spec.

Every op is timed exactly as the executor runs it: F (the last stage scales its loss by 1/(D*M)),
B and W through `autograd_split` (at stage 0 B is empty and W runs the whole backward, as in the
executor), BW as one `torch.autograd.backward`, and OPT's local work by the executor's own `_opt` on a
one-rank group (flatten the gradients, keep the pre-step snapshot, SGD step). Times are medians over
`repeats` after `warmup` rounds, with `torch.set_num_threads(threads)` (workers run with
OMP_NUM_THREADS=1). Memory is what autograd saves for backward, counted once per storage and without
the parameters. Hops and all-reduces are timed with gloo between threads of this process on loopback.
"""

from __future__ import annotations

import statistics
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from planner.contract import JobSpec
from runtime_adapter.autograd_split import stage_backward_input, stage_backward_weight
from runtime_adapter.comm import Groups, Waiter
from runtime_adapter.executor import Executor
from runtime_adapter.model import GPTConfig, StageModule, SyntheticData, build_stages
from runtime_adapter.reference import make_optimizer

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


@dataclass(frozen=True)
class CommMeasurement:
    """Measured communication: one activation hop and each stage's gradient all-reduce (ms)."""

    activation_ms: float
    allreduce_ms: list[float]


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return 1e3 * (time.perf_counter() - t), out


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

    def __init__(self, module: StageModule, cfg: GPTConfig, scale: float) -> None:
        self.module, self.scale = module, scale
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.tokens, self.targets = SyntheticData(cfg).microbatch(0, 0, 0)
        self.shape = (cfg.microbatch_size, cfg.seq_len, cfg.hidden)
        gen = torch.Generator().manual_seed(cfg.seed)
        self.act = torch.randn(self.shape, generator=gen)
        self.grad = torch.randn(self.shape, generator=gen)
        self.fixed = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.fixed |= {b.untyped_storage().data_ptr() for b in module.buffers()}

    def forward(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(stage input or None at stage 0, output or scaled loss), as executor F."""
        m = self.module
        inp = None if m.is_first else self.act.clone().requires_grad_()
        out = m(self.tokens if inp is None else inp, self.targets if m.is_last else None)
        return inp, (out * self.scale if m.is_last else out)

    def out_grad(self) -> list[torch.Tensor] | None:
        return None if self.module.is_last else [self.grad]

    def backward_input(self, inp: torch.Tensor | None, out: torch.Tensor) -> list[dict[str, Any]]:
        """Executor B: input gradient only (nothing at stage 0); the groups W needs."""
        if inp is None:
            return []
        _, groups = stage_backward_input([out], self.out_grad(), [inp], iter(self.params))
        return groups

    def backward_weight(self, out: torch.Tensor, groups: list[dict[str, Any]]) -> None:
        """Executor W: weight gradient from B's intermediates (the whole backward at stage 0)."""
        if self.module.is_first:
            torch.autograd.backward([out], self.out_grad())
        else:
            stage_backward_weight(iter(self.params), groups)

    def backward_fused(self, out: torch.Tensor) -> None:
        torch.autograd.backward([out], self.out_grad())

    def memory(self) -> tuple[float, float]:
        """(activation MiB held from F to B, MiB still held from the end of B to the end of W)."""
        saved: list[weakref.ref[torch.Tensor]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(weakref.ref(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inp, out = self.forward()
        alive = [t for t in (r() for r in saved) if t is not None]
        held = [*alive, out] + ([inp] if inp is not None else [])
        activation = _storages(held, self.fixed)
        if self.module.is_first:
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


def _one_rank_groups() -> Groups:
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, GLOO_TIMEOUT)
    return Groups(0, pg, {(0, 0): 0}, pg, {(0, 0): 0}, Waiter(threading.Event()))


def _measure_stage(
    module: StageModule, cfg: GPTConfig, num_pipelines: int, num_microbatches: int, warmup: int, repeats: int
) -> StageMeasurement:
    total = num_pipelines * num_microbatches
    bench = _StageBench(module, cfg, 1.0 / total)
    ex = Executor(module, cfg, (0, module.stage), num_pipelines, num_microbatches, make_optimizer)
    ex.groups = _one_rank_groups()
    times: dict[str, list[float]] = {"F": [], "B": [], "W": [], "BW": [], "OPT": []}
    for r in range(warmup + repeats):
        f_ms, (inp, out) = _timed(bench.forward)
        b_ms, groups = _timed(lambda: bench.backward_input(inp, out))  # noqa: B023
        w_ms, _ = _timed(lambda: bench.backward_weight(out, groups))  # noqa: B023
        _, (_, out2) = _timed(bench.forward)
        bw_ms, _ = _timed(lambda: bench.backward_fused(out2))  # noqa: B023
        opt_ms, _ = _timed(lambda: ex._opt(r, torch.ones(total), []))  # noqa: B023
        ex.optimizer.zero_grad(set_to_none=True)
        if r >= warmup:
            for k, v in zip(
                times, (f_ms, 0.0 if module.is_first else b_ms, w_ms, bw_ms, opt_ms), strict=True
            ):
                times[k].append(v)
    ex.groups.waiter.close()
    activation, weight_grad = bench.memory()
    med = {k: statistics.median(v) for k, v in times.items()}
    return StageMeasurement(
        stage=module.stage,
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
    cfg: GPTConfig,
    num_stages: int,
    num_pipelines: int = 1,
    num_microbatches: int = 1,
    repeats: int = 5,
    warmup: int = 2,
    threads: int = 1,
    progress: Progress | None = None,
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
        for module in build_stages(cfg, num_stages):
            if progress:
                progress(f"profiling stage {module.stage}/{num_stages - 1} ({repeats} repeats)")
            out.append(_measure_stage(module, cfg, num_pipelines, num_microbatches, warmup, repeats))
        return out
    finally:
        torch.set_num_threads(old)


def _run_ranks(size: int, body: Callable[[Any, int], float]) -> list[float]:
    """Run `body(group, rank)` on `size` gloo ranks (threads of this process); their results."""
    store, results = dist.HashStore(), [0.0] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(dist.ProcessGroupGloo(store, rank, size, GLOO_TIMEOUT), rank)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def measure_hop_ms(cfg: GPTConfig, repeats: int = 20, warmup: int = 3) -> float:
    """One activation (microbatch_size x seq_len x hidden float32) sent between two gloo ranks on
    loopback: median over `repeats` round trips, halved."""
    shape = (cfg.microbatch_size, cfg.seq_len, cfg.hidden)

    def body(pg: Any, rank: int) -> float:
        buf, trips = torch.randn(shape), []
        for _ in range(warmup + repeats):
            t = time.perf_counter()
            if rank == 0:
                pg.send([buf], 1, 0).wait()
                pg.recv([buf], 1, 1).wait()
            else:
                pg.recv([buf], 0, 0).wait()
                pg.send([buf], 0, 1).wait()
            trips.append(1e3 * (time.perf_counter() - t))
        return statistics.median(trips[warmup:]) / 2

    return _run_ranks(2, body)[0]


def measure_allreduce_ms(num_elements: int, num_peers: int, repeats: int = 10, warmup: int = 2) -> float:
    """All-reduce of `num_elements` float32 among `num_peers` gloo ranks on loopback (median, ms)."""

    def body(pg: Any, rank: int) -> float:
        flat, times = torch.randn(num_elements), []
        for _ in range(warmup + repeats):
            t = time.perf_counter()
            pg.allreduce([flat]).wait()
            times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times[warmup:])

    return max(_run_ranks(num_peers, body))


def measure_comm(
    cfg: GPTConfig, stages: list[StageMeasurement], num_pipelines: int, num_microbatches: int, repeats: int
) -> CommMeasurement:
    """The hop time and each stage's all-reduce (its gradients plus the D*M counts OPT adds)."""
    hop = measure_hop_ms(cfg, repeats=max(repeats, 10))
    counts = num_pipelines * num_microbatches
    allreduce = [measure_allreduce_ms(st.num_params + counts, num_pipelines, repeats) for st in stages]
    return CommMeasurement(hop, allreduce)


def job_spec_from_profile(
    name: str,
    stages: list[StageMeasurement],
    comm: CommMeasurement,
    num_pipelines: int,
    num_microbatches: int,
    memory_capacity_mib: float | None,
) -> JobSpec:
    """The job spec (docs/contract.md section 1): every stage field measured; `cross_pipeline_ms` is
    the measured hop (on one machine a re-routed hop is the same loopback transfer); capacity as given."""
    return JobSpec.model_validate(
        {
            "name": name,
            "num_pipelines": num_pipelines,
            "num_stages": len(stages),
            "num_microbatches": num_microbatches,
            "stages": [
                {
                    "forward": st.forward_ms,
                    "backward_input": st.backward_input_ms,
                    "backward_weight": st.backward_weight_ms,
                    "optimizer": st.optimizer_ms,
                    "activation_mib": st.activation_mib,
                    "weight_grad_mib": st.weight_grad_mib,
                    "backward_fused_measured": st.backward_fused_ms,
                }
                for st in stages
            ],
            "comm": {
                "activation_ms": comm.activation_ms,
                "cross_pipeline_ms": comm.activation_ms,
                "allreduce_ms": comm.allreduce_ms,
            },
            "memory_capacity_mib": memory_capacity_mib,
        }
    )


def format_table(stages: list[StageMeasurement], comm: CommMeasurement) -> str:
    """Per-stage table (ms, MiB) plus the communication figures."""
    head = f"{'stage':>5} {'params':>9} {'F':>8} {'B':>8} {'W':>8} {'B+W':>8} {'BW':>8} {'OPT':>7}"
    head += f" {'AR':>7} {'act MiB':>8} {'wgrad MiB':>9}"
    rows = [head]
    for st, ar in zip(stages, comm.allreduce_ms, strict=True):
        bw = st.backward_input_ms + st.backward_weight_ms
        rows.append(
            f"{st.stage:>5} {st.num_params:>9} {st.forward_ms:>8.2f} {st.backward_input_ms:>8.2f} "
            f"{st.backward_weight_ms:>8.2f} {bw:>8.2f} {st.backward_fused_ms:>8.2f} {st.optimizer_ms:>7.2f} "
            f"{ar:>7.2f} {st.activation_mib:>8.2f} {st.weight_grad_mib:>9.2f}"
        )
    rows.append(f"activation hop {comm.activation_ms:.3f} ms (also used for cross-pipeline hops)")
    return "\n".join(rows)
