"""Executor: runs one worker's lowered program, one iteration at a time.

F keeps the stage input and output; B computes the input gradient only and keeps what W needs
(torch.distributed.pipelining's stage_backward_input / stage_backward_weight); W accumulates the
parameter gradients; OPT all-reduces the gradients with the alive peers of the stage (plus a count per
micro-batch of the global batch, which must come back as exactly one), clips them if the Training says
so, sets the learning rate of the iteration and steps the stage's own optimizer. No global barrier,
except with global-norm clipping (every stage's squared norm is all-reduced over the world group).
Forward goes through `StageRunner.forward` (stage.py: per-micro-batch random stream, autocast, boundary
dtype). Activations and gradients between stages travel as CPU tensors on the world group (gloo, tag
matched: comm.py); the stage all-reduce on `groups.device` (the CUDA device under NCCL).
The pre-step state of the last step is kept so that a failure can roll the stage back and replay the
iteration (see worker.py).

A stage without parameters (a middle stage a re-partition left without a layer: migration.py) runs
the same ops: F returns its input tensor itself (the identity), B hands the output gradient back as
the input gradient, W has nothing to compute, the stage all-reduce carries only the counts, the
optimizer is `training.NoParameters` (torch optimizers refuse an empty parameter list).

The step becomes visible to the peers with the gradient all-reduce: once any peer's all-reduce returns,
every peer has contributed and the peers step (with global-norm clipping, once the norm exchange that
follows has returned too: every alive worker has then reached its OPT). `before_step` runs right before
the all-reduce (the worker writes its "stepping" record there), so a kill between the all-reduce and the
worker's "step" record leaves a record of the contribution. The last stage also sums its
micro-batches' (unscaled) losses: one `.item()` per iteration, in the record.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runtime_adapter.assignment import Assignment, MicroBatch, Worker
from runtime_adapter.autograd_split import stage_backward_input, stage_backward_weight
from runtime_adapter.comm import Groups, Interrupted
from runtime_adapter.grad_sum import GradSum
from runtime_adapter.lowering import (
    COMPUTE_OPS,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    Instr,
    Program,
    lower,
)
from runtime_adapter.stage import StageRunner, UserCodeError
from runtime_adapter.stall import StallWatch
from runtime_adapter.training import apply_lr, build_optimizer, clip_gradients

logger = logging.getLogger(__name__)

FaultHook = Callable[[int, Instr], None]
WATCHED_OPS = tuple(op for op in COMPUTE_OPS if op != "OPT")  # stall.py's; OPT's all-reduce waits on peers
REDUCED = Instr("REDUCED")  # the fault hook's point right after the gradient all-reduce returned


class ExactlyOnceError(RuntimeError):
    """The all-reduced micro-batch counts of a stage are not all one."""


@dataclass
class IterationRecord:
    """What one worker did in one iteration (accounting and timing)."""

    iteration: int
    version: int
    hosted: list[MicroBatch]
    op_ms: dict[str, float] = field(default_factory=dict)
    wall_ms: float = 0.0
    loss_sum: float | None = None  # last stage: sum of its micro-batches' unscaled mean losses
    loss_n: int = 0  # last stage: how many micro-batches that sum covers


class Executor:
    """Holds one stage's module and optimizer and runs programs on them."""

    def __init__(
        self,
        module: torch.nn.Module,
        runner: StageRunner,
        worker: Worker,
        num_pipelines: int,
        num_microbatches: int,
        fault: FaultHook | None = None,
        before_step: Callable[[IterationRecord], None] | None = None,
        stall: StallWatch | None = None,
    ) -> None:
        self.module, self.runner, self.worker = module, runner, worker
        self.num_pipelines, self.num_microbatches = num_pipelines, num_microbatches
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(runner.training, self.params)
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.grad_sum = GradSum(self.params, runner.training.exact_sums)
        self.fault, self.before_step, self.stall = fault, before_step, stall
        self.interrupted = threading.Event()
        self._version_lock = threading.Lock()
        self.version = 0
        self.stepped = 0
        self._snapshot: tuple[int, list[torch.Tensor], dict[str, Any]] | None = None
        self.program: Program | None = None
        self.groups: Groups | None = None

    def _busy(self, ins: Instr) -> contextlib.AbstractContextManager[None]:
        """A compute op runs under the stall watchdog (stall.py); the waits on peers do not."""
        if self.stall is None or ins.kind not in WATCHED_OPS:
            return contextlib.nullcontext()
        return self.stall.busy(str(ins))

    # -- verbs ----------------------------------------------------------------------------------------

    def begin_version(self, version: int) -> None:
        """From now on only a version above `version` interrupts (recovery for `version` starts)."""
        with self._version_lock:
            self.version = version
            self.interrupted.clear()

    def apply(self, assignment: Assignment, groups: Groups) -> Program:
        """Switch to a schedule version (at a safe point: between iterations)."""
        self.begin_version(assignment.version)
        self.program, self.groups = lower(assignment), groups
        return self.program

    def interrupt(self, version: int) -> None:
        """Version `version` exists: if it is newer than ours, stop at the next instruction or wait."""
        with self._version_lock:
            if version > self.version:
                self.interrupted.set()

    def run_iteration(self, iteration: int) -> IterationRecord:
        """Run the current program once for `iteration`; raises Interrupted or a communication error."""
        assert self.program is not None and self.groups is not None, "apply() a schedule first"
        if iteration != self.stepped:
            raise ValueError(f"iteration {iteration} requested but {self.stepped} iterations are stepped")
        t0 = time.perf_counter()
        rec = IterationRecord(iteration, self.program.version, [])
        run = _IterationRun(self, iteration, rec)
        try:
            for ins in self.program.instrs:
                if self.interrupted.is_set():
                    raise Interrupted(f"interrupted before {ins}")
                if self.fault is not None:
                    self.fault(iteration, ins)
                t = time.perf_counter()
                with self._busy(ins):
                    run.step(ins)
                rec.op_ms[ins.kind] = rec.op_ms.get(ins.kind, 0.0) + 1e3 * (time.perf_counter() - t)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.grad_sum.clear()
        rec.wall_ms = 1e3 * (time.perf_counter() - t0)
        return rec

    def rollback_to(self, iteration: int) -> None:
        """Return to the state after `iteration` steps (at most one step back)."""
        if self.stepped == iteration:
            return
        snap = self._snapshot
        if snap is None or self.stepped != iteration + 1 or snap[0] != iteration:
            raise RuntimeError(f"cannot roll back from {self.stepped} to {iteration} stepped iterations")
        with torch.no_grad():
            for p, saved in zip(self.params, snap[1], strict=True):
                p.copy_(saved)
        self.optimizer.load_state_dict(snap[2])
        self.stepped, self._snapshot = iteration, None
        logger.info("rolled back to %d stepped iterations", iteration)

    def state_bytes(self) -> bytes:
        """Parameters and optimizer state, serialized (re-join from a peer)."""
        buf = io.BytesIO()
        torch.save({"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}, buf)
        return buf.getvalue()

    def load_state_bytes(self, data: bytes, stepped: int) -> None:
        """Adopt a peer's state, which has `stepped` iterations stepped."""
        self.load_state(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), stepped)

    def load_state(self, state: dict[str, Any], stepped: int) -> None:
        """Adopt {"model", "optim"} (a peer's state or a checkpoint) with `stepped` iterations stepped."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.stepped, self._snapshot = stepped, None

    def reset_state(self, model: dict[str, Any]) -> None:
        """Start over: parameters `model` (a freshly built stage's: the initial ones), a fresh optimizer
        of the Training, nothing stepped (a restore without a complete checkpoint)."""
        self.module.load_state_dict(model)
        self.adopt(self.module, {})
        self.stepped = 0

    def optimizer_state(self) -> dict[int, Any]:
        """The optimizer's per-parameter state keyed by the parameter's position in `params` (module
        order), whatever order the Training's optimizer put its parameter groups in."""
        state = self.optimizer.state_dict()["state"]
        return {_position(self.params, self.optimizer)[j]: v for j, v in state.items()}

    def adopt(self, module: torch.nn.Module, optim_state: dict[int, Any]) -> None:
        """Run `module` from now on (migration.py: rebuilt for another layer range) with a fresh
        optimizer of the Training holding `optim_state` ({position in the module's trainable
        parameters: state}, as `optimizer_state` gives it); no rollback."""
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.runner.training, self.params)
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if optim_state:
            position = _position(self.params, self.optimizer)
            state = {j: optim_state[i] for j, i in enumerate(position) if i in optim_state}
            groups = self.optimizer.state_dict()["param_groups"]
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.grad_sum = GradSum(self.params, self.runner.training.exact_sums)
        self._snapshot = None

    # -- OPT ------------------------------------------------------------------------------------------

    def _opt(
        self, iteration: int, counts: torch.Tensor, sends: list[Any], rec: IterationRecord | None = None
    ) -> None:
        groups = self.groups
        assert groups is not None
        for work in sends:
            groups.waiter.wait(work, "a send")
        sends.clear()
        self.grad_sum.add()  # gradients not yet moved into the sums (a direct caller: the profiler)
        flat = torch.cat([self.grad_sum.flat(groups.device), counts.to(groups.device, self.grad_sum.dtype)])
        if self.before_step is not None and rec is not None:
            self.before_step(rec)  # from here on the peers may step with this worker's gradients
        groups.stage_waits.wait(groups.stage.allreduce([flat]), "the stage all-reduce")
        if self.fault is not None:
            self.fault(iteration, REDUCED)
        reduced_counts = flat[-counts.numel() :]
        if not bool(torch.all(reduced_counts == 1)):
            bad = [i for i, c in enumerate(reduced_counts.tolist()) if c != 1]
            raise ExactlyOnceError(f"stage {self.worker[1]} iteration {iteration}: counts {bad} are not 1")
        self.grad_sum.set_grads(flat)
        self.grad_sum.clear()
        self._clip(groups)
        apply_lr(self.optimizer, self.base_lrs, self.runner.training.lr_schedule, iteration)
        self._snapshot = (
            iteration,
            [p.detach().clone() for p in self.params],
            copy.deepcopy(self.optimizer.state_dict()),
        )
        self.optimizer.step()
        self.stepped = iteration + 1

    def _clip(self, groups: Groups) -> None:
        """Clip the all-reduced gradient (training.clip_gradients; global norm: MAX over the world)."""

        def exchange(norms: torch.Tensor) -> torch.Tensor:  # on the world group: gloo, CPU
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
            groups.waiter.wait(groups.world.allreduce([norms], opts), "the gradient-norm all-reduce")
            return norms

        r = self.runner
        clip_gradients(self.params, r.training.clip, r.stage, r.num_stages, exchange)


class _IterationRun:
    """Per-iteration state of one program run: stage inputs/outputs, posted receives, pending sends."""

    def __init__(self, ex: Executor, iteration: int, rec: IterationRecord) -> None:
        self.ex, self.iteration, self.rec = ex, iteration, rec
        self.module = ex.module
        self.inputs: dict[MicroBatch, torch.Tensor] = {}
        self.outputs: dict[MicroBatch, torch.Tensor] = {}
        self.out_grads: dict[MicroBatch, torch.Tensor | None] = {}
        self.in_grads: dict[MicroBatch, torch.Tensor | None] = {}
        self.param_groups: dict[MicroBatch, list[dict[str, Any]]] = {}
        self.sends: list[Any] = []
        assert ex.groups is not None
        self.counts = torch.zeros(ex.num_pipelines * ex.num_microbatches, device=ex.groups.device)
        self.scale = 1.0 / (ex.num_pipelines * ex.num_microbatches)
        self.recvs: dict[tuple[str, MicroBatch], tuple[Any, torch.Tensor]] = {}
        self.loss: torch.Tensor | None = None  # last stage: detached float64 sum of the unscaled losses
        self._post_receives()

    def _post_receives(self) -> None:
        groups, runner = self.ex.groups, self.ex.runner
        assert groups is not None and self.ex.program is not None
        dtype = runner.training.boundary_dtype
        for ins in self.ex.program.instrs:
            if ins.kind in (RECV_ACT, RECV_GRAD):
                assert ins.mb is not None and ins.peer is not None
                shape = runner.input_shape if ins.kind == RECV_ACT else runner.output_shape
                buf = torch.empty(shape, dtype=dtype)  # the world group is gloo: CPU tensors
                work = groups.world.recv([buf], groups.world_rank[ins.peer], ins.tag)
                self.recvs[(ins.kind, ins.mb)] = (work, buf)

    def _received(self, ins: Instr) -> torch.Tensor:
        assert ins.mb is not None and self.ex.groups is not None
        work, buf = self.recvs.pop((ins.kind, ins.mb))
        self.ex.groups.waiter.wait(work, f"{ins}")
        return buf.to(self.ex.runner.device)

    def _send(self, ins: Instr, tensor: torch.Tensor) -> None:
        groups, runner = self.ex.groups, self.ex.runner
        assert groups is not None and ins.peer is not None
        expected = runner.output_shape if ins.kind == SEND_ACT else runner.input_shape
        if tuple(tensor.shape) != tuple(expected):  # the receiver's buffer has `expected`'s size
            what = "output" if ins.kind == SEND_ACT else "input gradient"
            raise UserCodeError(
                f"stage {runner.stage}'s {what} of micro-batch {list(ins.mb or ())} has shape "
                f"{list(tensor.shape)}, but the boundary is {list(expected)} (Training.activation_shape, or "
                "what micro-batch [0, 0] of iteration 0 gave): every micro-batch must give one shape"
            )
        wire = tensor.detach().to("cpu", self.ex.runner.training.boundary_dtype).contiguous()
        self.sends.append(groups.world.send([wire], groups.world_rank[ins.peer], ins.tag))

    def step(self, ins: Instr) -> None:
        """Execute one instruction."""
        mb, kind = ins.mb, ins.kind
        if kind == "OPT":
            if self.ex.runner.is_last:
                self.rec.loss_sum = 0.0 if self.loss is None else float(self.loss)
            self.ex._opt(self.iteration, self.counts, self.sends, self.rec)
            return
        assert mb is not None
        if kind == RECV_ACT:
            self.inputs[mb] = self._received(ins).requires_grad_()
        elif kind == RECV_GRAD:
            self.out_grads[mb] = self._received(ins)
        elif kind == "F":
            self._forward(mb)
        elif kind == SEND_ACT:
            self._send(ins, self.outputs[mb])
        elif kind == "B":
            self._backward_input(mb)
        elif kind == SEND_GRAD:
            grad = self.in_grads.pop(mb)
            assert grad is not None, f"no input gradient for {mb}"
            self._send(ins, grad)
        elif kind == "W":
            self._backward_weight(mb)
        elif kind == "BW":
            out, grad = self.outputs.pop(mb), self.out_grads.pop(mb, None)
            inp = self.inputs.pop(mb, None)
            _backward(out, grad)
            if inp is not None:
                self.in_grads[mb] = inp.grad
            self._count(mb)
        else:
            raise ValueError(f"unknown instruction {ins}")

    def _forward(self, mb: MicroBatch) -> None:
        runner = self.ex.runner
        inputs, targets = runner.read(self.iteration, *mb)
        inp = inputs if runner.is_first else self.inputs[mb]
        assert inp is not None
        out = runner.forward(self.module, self.iteration, mb, inp, targets)
        if runner.is_last:
            loss = (
                out.detach().double()
            )  # float64: a failure regroups the sum (float32 differed in the 6th digit)
            self.loss = loss if self.loss is None else self.loss + loss
            self.rec.loss_n += 1
            out = out * self.scale
        self.outputs[mb] = out
        self.rec.hosted.append(mb)

    def _backward_input(self, mb: MicroBatch) -> None:
        grad = self.out_grads.get(mb)
        if self.ex.runner.is_first:
            return  # no input gradient to compute: W runs the whole backward
        out, inp = self.outputs[mb], self.inputs.pop(mb)
        dinputs, groups = stage_backward_input(
            [out], None if grad is None else [grad], [inp], iter(self.ex.params)
        )
        self.in_grads[mb], self.param_groups[mb] = dinputs[0], groups
        self.out_grads.pop(mb, None)

    def _backward_weight(self, mb: MicroBatch) -> None:
        if self.ex.runner.is_first:
            out, grad = self.outputs.pop(mb), self.out_grads.pop(mb, None)
            _backward(out, grad)
        else:
            self.outputs.pop(mb)
            stage_backward_weight(iter(self.ex.params), self.param_groups.pop(mb))
        self._count(mb)

    def _count(self, mb: MicroBatch) -> None:
        """Micro-batch `mb`'s backward is complete: move its gradients into the float64 sums."""
        self.ex.grad_sum.add()
        self.counts[mb[0] * self.ex.num_microbatches + mb[1]] += 1


def _backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """The whole backward of a stage output. An output without a graph is skipped: stage 0 without
    a layer or an embedding (an empty stage of a re-partition) passes its data through; a middle
    stage without a layer returns its input itself, a leaf whose backward just sets its `.grad`."""
    if out.requires_grad or out.grad_fn is not None:
        torch.autograd.backward([out], None if grad is None else [grad])


def _position(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> list[int]:
    """For each index of the optimizer's state dict (its groups' parameters in order), the position
    of that parameter in `params`."""
    where = {id(p): i for i, p in enumerate(params)}
    return [where[id(p)] for g in optimizer.param_groups for p in g["params"]]
