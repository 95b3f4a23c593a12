"""One stage of a `Training` as the runtime runs it: device, boundary shapes, data and forward.

The executor, the single-process reference (reference.py) and the profiler all run a micro-batch's
forward through `StageRunner.forward`, so the three see the same numbers: the random stream seeded
from (seed, iteration, pipeline, microbatch, stage), the same autocast, and the boundary cast to
`boundary_dtype` that the wire imposes between stages.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from planner.errors import InvalidInputError
from runtime_adapter.stage_state import BufferWatch, running_stats
from runtime_adapter.training import (
    StageTypeError,
    Training,
    build_optimizer,
    build_stage_module,
    microbatch_seed,
)

Shape = tuple[int, ...]


class NondeterministicDataError(InvalidInputError):
    """Two reads of the same micro-batch differ: exact replay after a failure would be wrong."""


class UserCodeError(InvalidInputError):
    """The training's own code (its data function, a stage's forward, the loss) raised, or returned
    what the runtime cannot use. Deterministic: re-routing the micro-batch to a peer would raise the
    same there, so the worker leaves with exit 2 and the launch stops with this line."""


# What a device fault (a GPU's, not the code's) says; those stay failures that re-routing handles.
DEVICE_FAULT_MARKS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "NCCL", "ECC error")


def device_fault(e: BaseException) -> bool:
    """Whether `e` is the device failing (torch.AcceleratorError, CUDA/cuBLAS/cuDNN/NCCL errors)
    rather than the user's code."""
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(e, accelerator):
        return True
    return any(mark in str(e) for mark in DEVICE_FAULT_MARKS)


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run the user's code `what` (e.g. "data(3, 0, 1)"): an exception from it becomes a
    UserCodeError naming `what` and the exception's first line, unless it is a device fault."""
    try:
        yield
    except InvalidInputError:
        raise
    except Exception as e:
        if device_fault(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserCodeError(f"{what} raised {type(e).__name__}: {first}") from e


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def infer_shapes(
    training: Training, num_stages: int, built: Sequence[nn.Module] | None = None
) -> list[Shape]:
    """The output shape of stages 0..P-2 (what goes over the wire), by running every stage on the meta
    device on micro-batch (0, 0, 0) (no memory, no compute); `activation_shape`, where set, must agree,
    and is taken as given for a model that does not run on meta. A stage whose forward changes a
    buffer of its state_dict is refused (stage_state.BufferWatch; the last one: check_loss_on_meta).
    `built`: the stages already built on the meta device (check_training's), else they are built."""
    if num_stages == 1:
        return []
    given = training.activation_shape
    try:
        x = _on_meta(training.data(0, 0, 0)[0])
        shapes: list[Shape] = []
        with torch.device("meta"), torch.no_grad():
            for s in range(num_stages - 1):
                module = build_stage_module(training, s, num_stages) if built is None else built[s]
                watch = BufferWatch(module, s)
                x = module(x)
                watch.check()  # a forward that changes a state_dict buffer is refused
                shapes.append(tuple(x.shape))
    except InvalidInputError:
        raise
    except Exception as e:
        if given is not None:  # a model that does not run on meta: the given shape is all there is
            return [tuple(given)] * (num_stages - 1)
        raise InvalidInputError(
            f"cannot infer the activation shapes on the meta device ({type(e).__name__}: {e}); "
            "set Training.activation_shape"
        ) from e
    for s, shape in enumerate(shapes):
        if given is not None and shape != tuple(given):  # else every receiver would allocate wrongly
            raise InvalidInputError(
                f"Training.activation_shape is {list(given)}, but stage {s} returns {list(shape)} on "
                "the meta device: set the shape every stage returns, or leave it unset to infer it"
            )
    return shapes


def check_partition_shapes(
    training: Training, num_stages: int, shapes: list[Shape], partition: Sequence[range]
) -> None:
    """InvalidInputError (one line naming the stage) for a `partition` whose stages (`LayerRanges.build`
    of its ranges, run on the meta device on micro-batch (0, 0, 0)) would send tensors of another
    shape than `shapes` (infer_shapes: the home split's boundaries, what every receiver allocates),
    e.g. a layer list whose first stage is left no layer sends the data itself: a check to run before
    any module changes. A model that does not run on the meta device is not checked."""
    ranges = training.layer_ranges
    if ranges is None or num_stages == 1 or len(partition) != num_stages:
        return
    try:
        x = _on_meta(training.data(0, 0, 0)[0])
        got: list[Shape] = []
        with torch.device("meta"), torch.no_grad():
            for s in range(num_stages - 1):
                x = ranges.build(s, num_stages, partition[s])(x)
                got.append(tuple(x.shape))
    except Exception:  # not runnable on the meta device: nothing to compare
        return
    for s, (shape, want) in enumerate(zip(got, shapes, strict=True)):
        if shape != tuple(want):
            r = partition[s]
            data = " (with no layer it sends its input: the data itself)" if s == 0 and not r else ""
            raise InvalidInputError(
                f"partition {[[q.start, q.stop] for q in partition]}: stage {s} holding layers "
                f"[{r.start}, {r.stop}) would send shape {list(shape)}{data}, but stage {s + 1} receives "
                f"{list(want)} (the model's own split): this model cannot run that partition"
            )


def check_training(
    training: Training, num_stages: int, num_pipelines: int, num_microbatches: int
) -> list[Shape]:
    """What can be checked before any process starts, each with its own one-line error: the data
    function (two reads of a few micro-batches agree, and they have the same shapes and dtypes: the
    stages exchange fixed-shape activations), every stage builds on the meta device and returns an
    nn.Module without running statistics, the boundary shapes (returned), and the loss's result."""
    first: tuple[tuple[int, int, int], list[tuple[torch.Size, torch.dtype]]] | None = None
    for it, d, m in data_samples(num_pipelines, num_microbatches):
        try:
            got = read_checked(training, it, d, m)
        except InvalidInputError:
            raise
        except Exception as e:
            raise InvalidInputError(f"data({it}, {d}, {m}) failed: {type(e).__name__}: {e}") from e
        layout = [(t.shape, t.dtype) for t in got]
        if first is None:
            first = ((it, d, m), layout)
        elif layout != first[1]:
            (i0, d0, m0), ref = first
            raise InvalidInputError(
                f"data({it}, {d}, {m}) returns (shape, dtype) {_layout(layout)}, data({i0}, {d0}, {m0}) "
                f"{_layout(ref)}: every micro-batch must have the same shapes (the stages exchange "
                "fixed-shape activations; pad or drop to a fixed length)"
            )
    built: list[nn.Module] = []  # on the meta device, for the shape, loss and buffer checks below
    for s in range(num_stages):
        try:
            with torch.device("meta"):
                module = build_stage_module(training, s, num_stages)
        except StageTypeError as e:
            raise InvalidInputError(str(e)) from e
        except Exception as e:  # the user's builder: IndexError, AssertionError, a meta-device failure...
            raise InvalidInputError(
                f"the model cannot be split into {num_stages} stages (stage {s} does not build on the meta "
                f"device): {type(e).__name__}: {e}"
            ) from e
        try:  # the optimizer too: a bad learning rate is bad input, not a worker's start-up crash
            build_optimizer(training, [p for p in module.parameters() if p.requires_grad])
        except Exception as e:
            raise InvalidInputError(
                f"optimizer(stage {s}'s parameters) failed: {type(e).__name__}: {e}"
            ) from e
        if running_stats(module):
            raise InvalidInputError(
                f"stage {s} has {running_stats(module)}, whose running statistics change in forward: a "
                "re-routed or replayed micro-batch would update them twice (use track_running_stats=False, "
                "or a LayerNorm)"
            )
        check_home_split(training, s, num_stages, module)
        built.append(module)
    shapes = infer_shapes(training, num_stages, built)
    check_loss_on_meta(training, shapes, built[-1])
    return shapes


def _param_shapes(module: nn.Module) -> list[Shape]:
    return [tuple(p.shape) for p in module.parameters()]


def check_home_split(training: Training, s: int, num_stages: int, module: nn.Module) -> None:
    """`layer_ranges.home(P)` must be the split `stage(s, P)` builds (a re-partition moves layers from
    there, and a job spec's `partition` is derived from it): stage s's parameters (their shapes, in
    order; names may differ) from `stage` (`module`, built on meta) and from `layer_ranges` agree."""
    ranges = training.layer_ranges
    if ranges is None:
        return
    held = ranges.home(num_stages)[s]
    try:
        with torch.device("meta"):
            torch.manual_seed(training.seed)
            ranged = _param_shapes(ranges.build(s, num_stages, held))
    except Exception:  # a builder that fails here fails where it is used, with its own error
        return
    own = _param_shapes(module)
    if own != ranged:
        raise InvalidInputError(
            f"stage {s} of {num_stages}: stage() builds {len(own)} parameter tensors, "
            f"layer_ranges.build(layers {held.start}-{held.stop - 1}) {len(ranged)} (or other shapes): "
            "stage() must build the split layer_ranges.home(P) gives, the even one (split_bounds): "
            "a model split with stages_from_layers(..., split) cannot also have layer_ranges"
        )


def checked_loss(loss: object, where: str) -> torch.Tensor:
    """`loss` if it is a floating-point tensor of one element (what backward and the loss sums need),
    else UserCodeError naming `where` ("micro-batch [0, 1] of iteration 3") and what it was."""
    if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1:
        return loss
    got = (
        f"a {loss.dtype} tensor of shape {list(loss.shape)}"
        if isinstance(loss, torch.Tensor)
        else f"a {type(loss).__name__}"
    )
    raise UserCodeError(
        f"the loss of {where} returned {got}: it must return a floating-point tensor of one element "
        "(reduce it: the mean over the micro-batch)"
    )


def check_loss_on_meta(training: Training, shapes: list[Shape], last: nn.Module | None = None) -> None:
    """The last stage and the loss on micro-batch (0, 0, 0) on the meta device (no memory, no compute;
    its input shaped as infer_shapes found, `shapes`): a loss that is no one-element float tensor, or
    a last stage whose forward changes a state_dict buffer, is refused before start. A model that
    does not run on meta is left to the first iteration, where an error is named the same way."""
    num_stages = len(shapes) + 1
    try:
        inputs, targets = training.data(0, 0, 0)
        with torch.device("meta"), torch.no_grad():
            x = torch.empty(shapes[-1], dtype=training.boundary_dtype) if shapes else _on_meta(inputs)
            module = build_stage_module(training, num_stages - 1, num_stages) if last is None else last
            watch = BufferWatch(module, num_stages - 1)
            loss = training.loss(module(x), _on_meta(targets))
    except Exception:
        return
    watch.check()
    checked_loss(loss, "micro-batch [0, 0] of iteration 0 (checked on the meta device)")


def data_samples(num_pipelines: int, num_microbatches: int) -> list[tuple[int, int, int]]:
    """The (iteration, pipeline, micro-batch) keys the start-up checks read."""
    samples = {
        (0, 0, 0),
        (0, 0, num_microbatches - 1),
        (0, 0, 1 % num_microbatches),
        (0, num_pipelines - 1, 0),
        (1, 0, 0),  # the next iteration
    }
    return sorted(samples)


def data_digest(training: Training, num_pipelines: int, num_microbatches: int) -> int:
    """A 62-bit digest of the sample micro-batches (shapes, dtypes, bytes): the same in every process
    whose data function is the same pure function of (iteration, pipeline, micro-batch). The workers
    compare theirs at every version (worker.py): a data function that differs between processes (an
    unseeded shuffle at load time, other files on another host) would feed a re-routed micro-batch
    other data than its own pipeline reads."""
    h = hashlib.sha256()
    for key in data_samples(num_pipelines, num_microbatches):
        for t in training.data(*key):
            t = t.detach().to("cpu").contiguous()
            h.update(f"{key} {list(t.shape)} {t.dtype}".encode())
            h.update(t.flatten().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "big") >> 2


def _layout(layout: list[tuple[torch.Size, torch.dtype]]) -> str:
    return ", ".join(f"({list(shape)}, {str(dtype).removeprefix('torch.')})" for shape, dtype in layout)


def read_checked(training: Training, iteration: int, d: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch [d, m] of `iteration`, read twice: NondeterministicDataError if the reads differ."""
    first, again = training.data(iteration, d, m), training.data(iteration, d, m)
    pair = isinstance(first, (tuple, list)) and len(first) == 2
    if not (pair and all(isinstance(t, torch.Tensor) for t in first)):
        got = type(first).__name__ + (f" of {len(first)}" if isinstance(first, (tuple, list)) else "")
        raise InvalidInputError(
            f"data({iteration}, {d}, {m}) must return (inputs, targets), two tensors: it returned a {got}"
        )
    for what, a, b in zip(("inputs", "targets"), first, again, strict=True):
        if not (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):
            raise NondeterministicDataError(
                f"data({iteration}, {d}, {m}) returned different {what} on a second call: the data "
                "function must be a pure function of (iteration, pipeline, microbatch)"
            )
    return first


def seed_generator(device: torch.device, seed: int) -> None:
    """Seed the generator random ops on `device` draw from: the CPU's, and on a GPU that device's
    (not `torch.manual_seed`, which also queues seeding of every other device: ~0.1-0.3 ms a call)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


@dataclass
class StageRunner:
    """Stage `stage` of `num_stages` of `training` on `device`."""

    training: Training
    stage: int
    num_stages: int
    device: torch.device
    shapes: list[Shape]  # infer_shapes(training, num_stages)
    check_data: bool = False

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def input_shape(self) -> Shape:
        """Shape of what this stage receives (not stage 0)."""
        return self.shapes[self.stage - 1]

    @property
    def output_shape(self) -> Shape:
        """Shape of what this stage sends (not the last stage)."""
        return self.shapes[self.stage]

    def build(self) -> nn.Module:
        """This stage's module on the device, in training mode (same initial weights on every peer)."""
        return build_stage_module(self.training, self.stage, self.num_stages).to(self.device).train()

    def read(self, iteration: int, d: int, m: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(inputs on stage 0, targets on the last stage) of micro-batch [d, m], on the device."""
        if not (self.is_first or self.is_last):
            return None, None
        with user_code(f"data({iteration}, {d}, {m})"):
            if self.check_data or self.training.check_data:
                inputs, targets = read_checked(self.training, iteration, d, m)
            else:
                inputs, targets = self.training.data(iteration, d, m)
        return (
            inputs.to(self.device) if self.is_first else None,
            targets.to(self.device) if self.is_last else None,
        )

    def forward(
        self,
        module: nn.Module,
        iteration: int,
        mb: tuple[int, int],
        inp: torch.Tensor,
        targets: torch.Tensor | None,
    ) -> torch.Tensor:
        """The stage output (cast to the boundary dtype), or on the last stage the unscaled loss; the
        random stream of (iteration, d, m, stage) is seeded first."""
        tr = self.training
        seed_generator(self.device, microbatch_seed(tr.seed, iteration, mb[0], mb[1], self.stage))
        autocast = (
            torch.autocast(self.device.type, dtype=tr.autocast)
            if tr.autocast is not None
            else contextlib.nullcontext()
        )
        where = f"micro-batch {list(mb)} of iteration {iteration}"
        with autocast:
            with user_code(f"stage {self.stage}'s forward of {where}"):
                out = module(inp)
            if self.is_last:
                assert targets is not None, "the last stage needs targets"
                with user_code(f"the loss of {where}"):
                    loss = tr.loss(out, targets)
                return checked_loss(loss, where).float()
        if not isinstance(out, torch.Tensor):
            raise UserCodeError(
                f"stage {self.stage}'s forward of {where} returned a {type(out).__name__}: a stage before "
                "the last must return one tensor (its activation, sent to the next stage)"
            )
        return out.to(tr.boundary_dtype)
