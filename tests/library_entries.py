"""Entry points for tests/test_runtime_library.py: a wrong return type and a data function that is
not a pure function of (iteration, pipeline, microbatch)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from runtime_adapter.model import training as gpt
from runtime_adapter.training import Training


def not_training() -> int:
    """Returns something that is not a Training."""
    return 42


def nondeterministic(**kwargs: Any) -> Training:
    """The reference GPT whose data draws from the global random generator."""
    base = gpt(**kwargs)

    def data(iteration: int, pipeline: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 64, (2, 16))
        return tokens, tokens

    return dataclasses.replace(base, data=data)


def broken(**kwargs: Any) -> Training:
    """An entry that fails inside the user's code."""
    raise RuntimeError("the user's entry is broken")
