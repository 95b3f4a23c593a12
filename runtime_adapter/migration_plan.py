"""Which worker sends which layers to whom when a schedule's `partition` moves layers (pure functions;
migration.py runs the plan), and the layer naming that lets one stage's state go to another.

Every alive worker reports the layer range its module holds now (a fresh re-joiner: nothing). For each
worker whose stage's range under the new partition holds a layer it lacks, the layer comes from a
live holder: the worker of the same pipeline if it holds it (its stage before the move), else the
lowest live worker that does (a peer of that stage, or a worker that already took the layer in an
earlier, interrupted migration). Fresh re-joiners are not planned: they take their stage's state from
a veteran peer afterwards, as on every re-join.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from runtime_adapter.assignment import Worker


class MigrationError(RuntimeError):
    """The layers cannot move: some layer (or a stage's state) has no live holder. Every worker of
    the version finds the same, and leaves for a restore (worker.py: EXIT_NEEDS_RESTORE, a `lost`
    record)."""


@dataclass(frozen=True)
class Transfer:
    """`src` sends the state of `layers` (parameters and optimizer state) to `dst`."""

    src: Worker
    dst: Worker
    layers: tuple[int, ...]


def plan_transfers(held: Mapping[Worker, range | None], target: Sequence[range]) -> list[Transfer]:
    """The transfers that give every worker of `held` (None: fresh, no state) the layers its stage
    holds under `target`, sorted (every worker computes the same list)."""
    holders: dict[int, list[Worker]] = {}
    for w, r in sorted(held.items()):
        for layer in r or ():
            holders.setdefault(layer, []).append(w)
    pairs: dict[tuple[Worker, Worker], list[int]] = {}
    for dst, r in sorted(held.items()):
        if r is None:
            continue
        for layer in target[dst[1]]:
            if layer in r:
                continue
            live = holders.get(layer)
            if not live:
                raise MigrationError(f"layer {layer}: no live worker holds it (stage {dst[1]} needs it)")
            src = next((w for w in live if w[0] == dst[0]), live[0])
            pairs.setdefault((src, dst), []).append(layer)
    return [Transfer(src, dst, tuple(layers)) for (src, dst), layers in sorted(pairs.items())]


def layer_of(name: str, layers: range, prefix: str) -> int | None:
    """The model-wide layer index of state entry `name` of a stage module holding `layers` (its j-th
    layer's entries are `<prefix><j>.*`); None for the stage's own parts (embedding, head)."""
    if not name.startswith(prefix):
        return None
    head, dot, _ = name[len(prefix) :].partition(".")
    return layers.start + int(head) if dot and head.isdigit() else None


def to_global(name: str, layers: range, prefix: str) -> str:
    """`name` with its local layer index replaced by the model-wide one (stage parts unchanged)."""
    layer = layer_of(name, layers, prefix)
    if layer is None:
        return name
    rest = name[len(prefix) :].partition(".")[2]
    return f"{prefix}{layer}.{rest}"


def to_local(name: str, layers: range, prefix: str) -> str:
    """The inverse of `to_global` for a module holding `layers`."""
    layer = layer_of(name, range(0, 1 << 62), prefix)
    if layer is None:
        return name
    rest = name[len(prefix) :].partition(".")[2]
    return f"{prefix}{layer - layers.start}.{rest}"


def globalize(state: Mapping[str, object], layers: range, prefix: str) -> dict[str, object]:
    """A stage's {local name: value} as {model-wide name: value}."""
    return {to_global(k, layers, prefix): v for k, v in state.items()}
