"""Start-up checks for state a stage's forward changes besides its output.

What a step changes must be the parameters and the optimizer's state (docs/library.md, "State"):
those are rolled back, copied to a re-joiner and checkpointed. A buffer in the module's state_dict
that the forward updates (BatchNorm's running statistics, a step counter) is none of that: the peers
of a stage host different micro-batches, so their copies drift apart, and a replayed micro-batch
updates it twice. Such stages are refused before start. Buffers outside the state_dict
(`persistent=False`: a rotary embedding's cos/sin cache) are caches and may change.
"""

from __future__ import annotations

from torch import nn

from planner.errors import InvalidInputError


def running_stats(module: nn.Module) -> str | None:
    """The name of a submodule whose forward updates buffers (batch norm with running statistics)."""
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            return f"{type(m).__name__} {name or '(the stage)'}"
    return None


class BufferWatch:
    """The state_dict buffers of `module` before a forward: `check` after it raises InvalidInputError
    naming the first one the forward changed in place or replaced (tensor version counters count
    in-place writes, on the meta device too)."""

    def __init__(self, module: nn.Module, stage: int) -> None:
        self.module, self.stage = module, stage
        kept = set(module.state_dict(keep_vars=True))
        self.before = {n: (b, b._version) for n, b in module.named_buffers() if n in kept}

    def check(self) -> None:
        now = dict(self.module.named_buffers())
        for name, (tensor, version) in self.before.items():
            if now.get(name) is not tensor or tensor._version != version:
                raise InvalidInputError(
                    f"stage {self.stage}'s forward changes its buffer {name!r}: state a forward updates is "
                    "not rolled back and drifts apart between the peers of a stage (each hosts other "
                    "micro-batches); keep such state out of the forward, or register a cache with "
                    "persistent=False"
                )
