"""Split backward: B (input gradient) then W (weight gradient), without recomputing B's work in W.

The functions are torch.distributed.pipelining's stage_backward_input / stage_backward_weight. Importing
that package pulls in dynamo and DTensor (3-4 s per worker process on CPU), so its `_backward.py` is
loaded on its own under a private package name; if that ever fails, the public import is used.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

import torch


def _load() -> Any:
    name = "_recycle_pipelining_backward"
    try:
        pkg = sys.modules.get(name)
        if pkg is None:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(Path(torch.__file__).parent / "distributed" / "pipelining")]
            sys.modules[name] = pkg
        return importlib.import_module(f"{name}._backward")
    except Exception:  # pragma: no cover - depends on torch's layout
        from torch.distributed.pipelining import _backward

        return _backward


_backward = _load()
stage_backward_input = _backward.stage_backward_input
stage_backward_weight = _backward.stage_backward_weight
