"""What a stage checkpoint holds, flattened for torch.distributed.checkpoint (checkpoint.py writes and
reads it).

DCP stores a flat {name: tensor} dict: one tensor per state tensor (`t<i>:<path>`, in traversal order)
plus `skeleton`, the torch.save'd structure of {stage, stepped, model, optim} with every tensor
replaced by a meta tensor. So a plain torch.optim state dict (integer parameter ids, empty state,
tuples) comes back exactly as it was, which DCP's own nested-dict flattening does not guarantee (it
turns integer keys into strings and drops empty dicts).
"""

from __future__ import annotations

import io
from typing import Any

import torch


class _Flattener:
    """Copies every tensor of a nested state to the CPU (into `tensors`, named `t<i>:<path>`) and
    returns the structure with meta tensors in their place. `reuse`: the buffers of a previous staging
    of the same structure, copied into instead of allocated (a fresh allocation costs page faults:
    several times the copy itself on the machine of docs/benchmarks.md)."""

    def __init__(self, reuse: dict[str, torch.Tensor] | None) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.reuse = reuse or {}
        self.seen: dict[int, torch.Tensor] = {}  # a tensor listed twice (tied weights) is copied once

    def __call__(self, obj: Any, path: str = "") -> Any:
        if isinstance(obj, torch.Tensor):
            copy = self.seen.get(id(obj))
            name = f"t{len(self.tensors)}:{path}"
            if copy is None:
                old = self.reuse.get(name)
                if (
                    old is not None
                    and old.shape == obj.shape
                    and old.dtype == obj.dtype
                    and old.is_contiguous()
                ):
                    copy = old.copy_(obj.detach())
                else:
                    copy = obj.detach().to("cpu", copy=True)
                self.seen[id(obj)] = copy
            self.tensors[name] = copy
            return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
        if isinstance(obj, dict):
            return {k: self(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            items = [self(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj


def _unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of `_Flattener`: meta tensors replaced, in order, by `tensors` (consumed)."""
    if isinstance(obj, torch.Tensor):
        t = tensors.pop()
        if t.shape != obj.shape or t.dtype != obj.dtype:
            raise ValueError(
                f"checkpoint tensor {tuple(t.shape)} {t.dtype}: expected {tuple(obj.shape)} {obj.dtype}"
            )
        return t
    if isinstance(obj, dict):
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [_unflatten(v, tensors) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def stage_state(
    stage: int,
    stepped: int,
    model: dict[str, Any],
    optim: dict[str, Any],
    reuse: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The flat {name: tensor} dict DCP writes: copies of every tensor plus the skeleton (`reuse`: an
    earlier result whose buffers may be overwritten)."""
    flatten = _Flattener(reuse)
    skeleton = flatten({"stage": stage, "stepped": stepped, "model": model, "optim": optim})
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    flatten.tensors["skeleton"] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    return flatten.tensors


def unstage(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The inverse of `stage_state`: {stage, stepped, model, optim} from the flat dict DCP read
    (`flat` is consumed)."""
    skeleton = torch.load(io.BytesIO(flat.pop("skeleton").numpy().tobytes()), weights_only=True)
    ordered = sorted(flat.items(), key=lambda kv: int(kv[0][1 : kv[0].index(":")]))
    state: dict[str, Any] = _unflatten(skeleton, [t for _, t in reversed(ordered)])
    return state
