"""Layer migration: a version whose schedule `partition` differs from the layers a worker's module holds
moves layers between stages at the version change, before the first op of the next iteration.

All alive workers of the version take part (worker.py calls `migrate` during recovery, after the
rollback, so every module is at the same stepped count k):

1. all-gather over the world group of the layer range each worker holds (a fresh re-joiner: none);
2. the same plan everywhere (migration_plan.plan_transfers): each layer a worker's stage now holds
   and it lacks comes from a live holder, preferably the old stage's worker of its own pipeline;
3. per transfer, the sender packs the layers' parameters and optimizer state (model-wide names; no
   gradients: they are summed afresh every iteration) and sends them point to point on the version's
   world group (its size first, then the bytes; every receive is posted before the sends, so no
   order can deadlock);
4. each worker whose range changes builds its new stage module aside (`LayerRanges.build` without
   the random initialisation: every entry is loaded next) and loads the kept and received state and
   the optimizer state into it, the running module untouched;
5. a world all-reduce: every worker has its new module ready. Only then does any worker switch to it
   (a fresh optimizer holding the moved optimizer state). A death before that point (a sender before,
   during or after its sends; a receiver) makes the waits fail or a newer version interrupt them:
   nobody has changed anything, and the next version re-plans the migration from the ranges the live
   workers really hold. (A death inside the final all-reduce can let some workers switch and not
   others; the next version's all-gather sees exactly that. A layer left without a live holder makes
   every worker's plan raise MigrationError before anything moves: the job's state is lost, and
   worker.py leaves for a restore from the newest complete checkpoint.)

A partition may leave a stage no layer (an empty range [a, a): a stage short of workers hands all its
layers to its neighbours). Its module is then `LayerRanges.build` of the empty range: the stage's
extras alone (embedding, head), or the identity for a middle stage, whose workers only pass
activations forward and gradients back; it has no parameters, an empty all-reduce apart from the
counts and the `training.NoParameters` optimizer; it sends everything and receives nothing, and on the
way back receives everything. Two empty ranges compare equal (range semantics): moving an empty
stage's position moves nothing.

The stage all-reduce groups need nothing: they are per stage and per version, and after the migration
every worker of a stage holds the same layers. A fresh re-joiner builds its module for the new range
(`reshape`) and then takes its peers' state as on every re-join. Training without `layer_ranges`
refuses a partition other than the even split (`MigrationUnsupported`).
"""

from __future__ import annotations

import io
import logging
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from planner.errors import InvalidInputError
from runtime_adapter.assignment import Assignment, Worker
from runtime_adapter.comm import Groups
from runtime_adapter.executor import Executor
from runtime_adapter.lowering import Instr
from runtime_adapter.migration_plan import (
    MigrationError,
    Transfer,
    globalize,
    layer_of,
    plan_transfers,
    to_global,
)
from runtime_adapter.stage import check_partition_shapes
from runtime_adapter.training import split_bounds

logger = logging.getLogger(__name__)

MIGRATE = Instr("MIGRATE")  # the fault hook's point: the plan is known, no tensor has moved yet
TAG = 1 << 24  # migration tags (2 per transfer) start here, far above the lowering's


class MigrationUnsupported(InvalidInputError):
    """A schedule moves layers, but the Training cannot build a stage from a layer range."""


_I = torch.nn.init
_RANDOM_INIT = {
    torch.Tensor.uniform_, torch.Tensor.normal_, _I.uniform_, _I.normal_, _I.trunc_normal_,
    _I.kaiming_uniform_, _I.kaiming_normal_, _I.xavier_uniform_, _I.xavier_normal_,
}  # fmt: skip


class _NoInit(TorchFunctionMode):
    """Skip the random initialisation of parameters built under it (they are loaded right after;
    deterministic buffers such as a causal mask are still computed)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _RANDOM_INIT:
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


def _to_bytes(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


class Migrator:
    """The layer range one worker's module holds, and the moves that change it."""

    def __init__(self, ex: Executor, num_stages: int) -> None:
        self.ex, self.num_stages, self.stage = ex, num_stages, ex.runner.stage
        self.ranges = ex.runner.training.layer_ranges
        self.home = self.ranges.home(num_stages) if self.ranges is not None else None
        self.layers: range | None = self.home[self.stage] if self.home is not None else None
        self._checked: list[range] | None = None  # the last partition check_partition_shapes passed

    def partition(self, a: Assignment) -> list[range] | None:
        """The layer range of every stage under `a` (None: a model without layer ranges, unmoved)."""
        if a.partition is None:
            return self.home
        part, n = list(a.partition), a.partition[-1].stop
        if self.ranges is None:
            even = split_bounds(n, self.num_stages) if len(part) == self.num_stages else []
            if part == [range(even[s], even[s + 1]) for s in range(len(even) - 1)]:
                return None
            raise MigrationUnsupported(
                f"schedule v{a.version} moves layers between stages (partition "
                f"{[[r.start, r.stop] for r in part]}) but the Training has no layer_ranges: only "
                "models built from layer ranges (the reference GPT, training.layer_ranges_from_layers) "
                "can be re-partitioned"
            )
        if len(part) != self.num_stages or n != self.ranges.num_layers:
            raise MigrationUnsupported(
                f"schedule v{a.version}: partition has {len(part)} ranges over {n} layers; the model has "
                f"{self.num_stages} stages and {self.ranges.num_layers} layers"
            )
        if part != self.home and part != self._checked:  # every worker refuses it alike, nothing moved
            runner = self.ex.runner
            try:
                check_partition_shapes(runner.training, self.num_stages, runner.shapes, part)
            except InvalidInputError as e:
                raise MigrationUnsupported(f"schedule v{a.version}: {e}") from None
            self._checked = part
        return part

    def moved(self, a: Assignment) -> bool:
        """Whether some stage holds other layers than its own under `a` (or this module does now)."""
        part = self.partition(a)
        return (part is not None and part != self.home) or (
            self.home is not None and self.layers != self.home[self.stage]
        )

    def settled(self, a: Assignment, fresh: bool) -> bool:
        """Whether this worker needs no transfer for `a` (a fresh one only reshapes)."""
        part = self.partition(a)
        return fresh or part is None or part[self.stage] == self.layers

    def follow(self, a: Assignment, groups: Groups, fresh: bool, settled: bool) -> list[dict[str, Any]]:
        """The worker's step during recovery for `a` (after the rollback): a fresh re-joiner reshapes
        its module; unless every worker already holds `a`'s layers (`settled`, agreed), everyone
        migrates. The accounting records to write."""
        if fresh:
            self.reshape(a)  # its state comes from a veteran peer next, for the new layer range
        return [] if settled else [self.migrate(a, groups, fresh)]

    def where(self) -> dict[str, list[int]]:
        """{"layers": [first, end)} of the module (for the `done` record), or {} without layer ranges."""
        return {} if self.layers is None else {"layers": [self.layers.start, self.layers.stop]}

    def reshape(self, a: Assignment) -> None:
        """A worker without state to keep (a fresh re-joiner; a restore): build the module for `a`'s
        range, with a fresh optimizer (its state is loaded next)."""
        part = self.partition(a)
        if part is not None and part[self.stage] != self.layers:
            self._adopt(part[self.stage], {}, {}, keep=False)
        elif part is not None:
            self.layers = part[self.stage]  # the same module (an empty range at another index)

    def reshape_home(self) -> None:
        """Put the module back on its stage's own layers, without state (a restore loads next)."""
        if self.home is not None and self.layers != self.home[self.stage]:
            self._adopt(self.home[self.stage], {}, {}, keep=False)

    def migrate(self, a: Assignment, groups: Groups, fresh: bool) -> dict[str, Any]:
        """Move layers so that every worker's module holds its stage's range under `a` (collective over
        the world group); the accounting record (`migration`)."""
        part = self.partition(a)
        assert part is not None and self.ranges is not None
        t0, me = time.perf_counter(), a.worker
        rank = groups.world_rank
        info = torch.zeros(len(rank), 3, dtype=torch.int64)
        if not fresh and self.layers is not None:
            info[rank[me]] = torch.tensor([1, self.layers.start, self.layers.stop])
        groups.waiter.wait(groups.world.allreduce([info]), "the migration's all-gather")
        held = {w: range(int(info[r, 1]), int(info[r, 2])) if info[r, 0] else None for w, r in rank.items()}
        transfers = plan_transfers(held, part)
        t_plan = time.perf_counter()
        if self.ex.fault is not None:
            self.ex.fault(self.ex.stepped, MIGRATE)
        before, after = self.layers, part[self.stage]
        received, sent = self._exchange(groups, transfers, me)
        t_moved = time.perf_counter()
        ready = None  # the new module and optimizer state, loaded aside (the running module untouched)
        if not fresh and after != before:
            model: dict[str, Any] = {}
            optim: dict[str, Any] = {}
            for blob in received:
                model.update(blob["model"])
                optim.update(blob["optim"])
            ready = self._prepare(after, model, optim, keep=True)
        t_built = time.perf_counter()
        barrier = torch.zeros(1)
        groups.waiter.wait(groups.world.allreduce([barrier]), "the migration's commit all-reduce")
        t_agreed = time.perf_counter()
        if ready is not None:
            self.ex.adopt(*ready)
        if not fresh:
            self.layers = after  # (two empty ranges are equal: an empty stage's module is the same)
        ms = 1e3 * (time.perf_counter() - t0)
        got = sum(len(t.layers) for t in transfers if t.dst == me)
        record = {
            "event": "migration", "version": a.version, "stepped": self.ex.stepped,
            "from": None if before is None or fresh else [before.start, before.stop],
            "to": [part[self.stage].start, part[self.stage].stop], "layers_in": got,
            "sent_mib": sent / 2**20, "received_mib": sum(b["bytes"] for b in received) / 2**20,
            "transfers": len(transfers), "ms": ms, "estimated_ms": a.migration_ms,
            "phases_ms": {  # plan (all-gather), transfers (pack, send, unpack), build and load the new
                # module aside, commit all-reduce, switch to it
                "plan": 1e3 * (t_plan - t0), "transfer": 1e3 * (t_moved - t_plan),
                "build": 1e3 * (t_built - t_moved), "agree": 1e3 * (t_agreed - t_built),
                "switch": ms - 1e3 * (t_agreed - t0),
            },
        }  # fmt: skip
        logger.info(
            "migration v%d: layers %s -> %s, %d transfer(s), %.3f MiB in, %.3f MiB out, %.1f ms "
            "(plan: %s ms)",
            a.version, record["from"], record["to"], len(transfers), record["received_mib"],
            record["sent_mib"], ms, a.migration_ms,
        )  # fmt: skip
        return record

    def _exchange(
        self, groups: Groups, transfers: list[Transfer], me: Worker
    ) -> tuple[list[dict[str, Any]], int]:
        """Run this worker's part of `transfers`: the blobs it received, the bytes it sent."""
        rank, world = groups.world_rank, groups.world
        packed: dict[tuple[int, ...], torch.Tensor] = {}  # the same layers to several receivers: packed once
        for t in transfers:
            if t.src == me and t.layers not in packed:
                packed[t.layers] = self._pack(t.layers)
        outgoing = {i: packed[t.layers] for i, t in enumerate(transfers) if t.src == me}
        sizes = {i: torch.zeros(1, dtype=torch.int64) for i, t in enumerate(transfers) if t.dst == me}
        works = [world.recv([buf], rank[transfers[i].src], TAG + 2 * i) for i, buf in sizes.items()]
        heads = {i: torch.tensor([blob.numel()], dtype=torch.int64) for i, blob in outgoing.items()}
        works += [world.send([h], rank[transfers[i].dst], TAG + 2 * i) for i, h in heads.items()]
        self._wait_all(groups, works, "the migration's sizes")
        payloads = {i: torch.empty(int(buf.item()), dtype=torch.uint8) for i, buf in sizes.items()}
        works = [world.recv([buf], rank[transfers[i].src], TAG + 2 * i + 1) for i, buf in payloads.items()]
        works += [world.send([b], rank[transfers[i].dst], TAG + 2 * i + 1) for i, b in outgoing.items()]
        self._wait_all(groups, works, "the migration's layer state")
        received = []
        for buf in payloads.values():
            blob = torch.load(io.BytesIO(buf.numpy().tobytes()), map_location="cpu", weights_only=True)
            received.append({**blob, "bytes": buf.numel()})
        return received, sum(b.numel() for b in outgoing.values())

    @staticmethod
    def _wait_all(groups: Groups, works: list[Any], what: str) -> None:
        for work in works:
            groups.waiter.wait(work, what)

    def _named(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This module's state and optimizer state by model-wide name."""
        assert self.ranges is not None and self.layers is not None
        ex, prefix = self.ex, self.ranges.prefix
        names = [n for n, p in ex.module.named_parameters() if p.requires_grad]
        optim = {names[i]: v for i, v in ex.optimizer_state().items()}
        return globalize(ex.module.state_dict(), self.layers, prefix), globalize(optim, self.layers, prefix)

    def _build(self, layers: range) -> torch.nn.Module:
        """This stage's module holding `layers`, on the device, in training mode, its parameters not
        initialised (every entry of its state is loaded next)."""
        assert self.ranges is not None
        with _NoInit():
            module = self.ranges.build(self.stage, self.num_stages, layers)
        return module.to(self.ex.runner.device).train()

    def _pack(self, layers: tuple[int, ...]) -> torch.Tensor:
        """The state of `layers` (parameters, buffers, optimizer state), serialized, on the CPU."""
        assert self.ranges is not None
        model, optim = self._named()
        inside = set(layers)

        prefix = self.ranges.prefix

        def pick(d: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in d.items() if layer_of(k, range(0, 1 << 62), prefix) in inside}

        return _to_bytes({"model": pick(model), "optim": pick(optim)})

    def _prepare(
        self, layers: range, moved_model: dict[str, Any], moved_optim: dict[str, Any], keep: bool
    ) -> tuple[torch.nn.Module, dict[int, Any]]:
        """A new module holding `layers`, loaded with the kept state (`keep`) plus the moved one, and
        its optimizer state by parameter position (Executor.adopt); the running module untouched.
        Without state (`keep` False, nothing moved) the module keeps the build's own initialisation
        (a load follows: a peer's state, a checkpoint)."""
        assert self.ranges is not None
        prefix = self.ranges.prefix
        keep_model, keep_optim = self._named() if keep else ({}, {})
        model, optim = {**keep_model, **moved_model}, {**keep_optim, **moved_optim}
        if not model:
            return self.ranges.build(self.stage, self.num_stages, layers).to(
                self.ex.runner.device
            ).train(), {}
        module = self._build(layers)
        local = module.state_dict()
        missing = [g for k in local if (g := to_global(k, layers, prefix)) not in model]
        if missing:
            raise MigrationError(f"layers {layers.start}-{layers.stop - 1}: no state for {missing[:3]}")
        module.load_state_dict({k: model[to_global(k, layers, prefix)] for k in local})
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        state = {i: optim[g] for i, n in enumerate(names) if (g := to_global(n, layers, prefix)) in optim}
        return module, state

    def _adopt(
        self, layers: range, moved_model: dict[str, Any], moved_optim: dict[str, Any], keep: bool
    ) -> None:
        """Switch now to a module holding `layers` (`_prepare`)."""
        self.ex.adopt(*self._prepare(layers, moved_model, moved_optim, keep))
        self.layers = layers
