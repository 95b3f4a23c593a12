"""Entry points: `package.module:function` returns the `Training` every worker runs.

`--entry` names the function and `--model` (JSON) its keyword arguments; the default entry is the
reference GPT (`runtime_adapter.model:training`, keyword arguments: GPTConfig fields). The directory
the command runs in is importable, as with `python -m`. Everything that can go wrong is an
InvalidInputError naming the problem (exit 2 before any process starts).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

from planner.errors import InvalidInputError
from runtime_adapter.cli_inputs import DEFAULT_ENTRY
from runtime_adapter.training import Training

__all__ = ["DEFAULT_ENTRY", "load_entry"]


def load_entry(entry: str, kwargs: dict[str, Any]) -> Training:
    """Import `entry` ("package.module:function") and call it with `kwargs`; the Training it returns."""
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidInputError(f"--entry {entry!r}: expected package.module:function")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any error is theirs to see
        raise InvalidInputError(
            f"--entry {entry!r}: cannot import {module_name}: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise InvalidInputError(f"--entry {entry!r}: {module_name} has no function {attr}")
    try:
        training = fn(**kwargs)
    except (TypeError, ValueError) as e:  # bad keyword arguments or values
        raise InvalidInputError(f"--entry {entry!r} with --model {json.dumps(kwargs)}: {e}") from e
    except Exception as e:  # the user's code failed
        raise InvalidInputError(f"--entry {entry!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(training, Training):
        raise InvalidInputError(
            f"--entry {entry!r} returned {type(training).__name__}: it must return a "
            "runtime_adapter.training.Training"
        )
    return training
