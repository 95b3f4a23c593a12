"""Entry points for tests/test_runtime_library.py: a wrong return type, a data function that is not a
pure function of (iteration, pipeline, microbatch), micro-batches of varying shapes, a failing entry,
a stage with batch norm, data that differs between processes."""

from __future__ import annotations

import dataclasses
import os
import threading
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


def varying_shapes(**kwargs: Any) -> Training:
    """The reference GPT whose micro-batches have 2 or 3 rows (a pure function, but not one shape)."""
    base = gpt(**kwargs)

    def data(iteration: int, pipeline: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = 2 + (iteration + microbatch) % 2
        tokens = torch.arange(rows * 16).reshape(rows, 16) % 64
        return tokens, tokens

    return dataclasses.replace(base, data=data)


def one_tensor(**kwargs: Any) -> Training:
    """The reference GPT whose data returns the tokens alone, not (inputs, targets)."""
    base = gpt(**kwargs)

    def data(iteration: int, pipeline: int, microbatch: int) -> torch.Tensor:
        return torch.zeros(2, 16, dtype=torch.long)

    return dataclasses.replace(base, data=data)  # type: ignore[arg-type]


def broken(**kwargs: Any) -> Training:
    """An entry that fails inside the user's code."""
    raise RuntimeError("the user's entry is broken")


def batch_norm(**kwargs: Any) -> Training:
    """The reference GPT with a BatchNorm (running statistics) on its last stage."""
    base = gpt(**kwargs)

    def stage(s: int, num_stages: int) -> torch.nn.Module:
        module = base.stage(s, num_stages)
        return torch.nn.Sequential(torch.nn.BatchNorm1d(16), module) if s == num_stages - 1 else module

    return dataclasses.replace(base, stage=stage)


class _Counted(torch.nn.Module):
    """A stage that counts its forwards in a buffer of its state_dict (persistent) or in a cache
    (`persistent=False`, replaced each forward as a rotary embedding's cos/sin cache is)."""

    def __init__(self, module: torch.nn.Module, persistent: bool) -> None:
        super().__init__()
        self.module, self.persistent = module, persistent
        self.register_buffer("seen", torch.zeros(()), persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.persistent:
            self.seen += 1
        else:
            self.seen = self.seen + 1
        return self.module(x)


def step_counter(**kwargs: Any) -> Training:
    """The reference GPT whose stage 0 counts its forwards in a state_dict buffer (refused)."""
    base = gpt(**kwargs)

    def stage(s: int, num_stages: int) -> torch.nn.Module:
        module = base.stage(s, num_stages)
        return _Counted(module, persistent=True) if s == 0 else module

    return dataclasses.replace(base, stage=stage)


def forward_cache(**kwargs: Any) -> Training:
    """The reference GPT whose last stage replaces a non-persistent buffer in forward (a cache: fine)."""
    base = gpt(**kwargs)

    def stage(s: int, num_stages: int) -> torch.nn.Module:
        module = base.stage(s, num_stages)
        return _Counted(module, persistent=False) if s == num_stages - 1 else module

    return dataclasses.replace(base, stage=stage)


def drifting(**kwargs: Any) -> Training:
    """The reference GPT whose data function is pure in iterations 0 and 1 only (the pre-start check,
    which reads both, passes; `--check-data` must catch it while training)."""
    base = gpt(**kwargs)
    calls = [0]

    def data(iteration: int, pipeline: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = base.data(iteration, pipeline, microbatch)
        calls[0] += 1
        return (tokens + calls[0]) % 64 if iteration > 1 else tokens, targets

    return dataclasses.replace(base, data=data)


def exhausted(**kwargs: Any) -> Training:
    """The reference GPT whose data function raises from iteration 2 on (its own bug, mid-run)."""
    base = gpt(**kwargs)

    def data(iteration: int, pipeline: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if iteration >= 2:
            raise IndexError("dataset exhausted")
        return base.data(iteration, pipeline, microbatch)

    return dataclasses.replace(base, data=data)


def shorter_from_iteration_2(**kwargs: Any) -> Training:
    """The reference GPT whose micro-batches hold one sample fewer from iteration 2 on: stage 0's
    output no longer has the boundary's shape."""
    base = gpt(**kwargs)

    def data(iteration: int, pipeline: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = base.data(iteration, pipeline, microbatch)
        return (tokens[:-1], targets[:-1]) if iteration >= 2 else (tokens, targets)

    return dataclasses.replace(base, data=data)


def bad_optimizer(**kwargs: Any) -> Training:
    """The reference GPT whose optimizer factory refuses its learning rate (torch raises)."""
    return dataclasses.replace(gpt(**kwargs), optimizer=lambda params: torch.optim.SGD(params, lr=-1.0))


def no_layer_ranges(**kwargs: Any) -> Training:
    """The reference GPT without `layer_ranges`: its stages cannot be re-partitioned."""
    return dataclasses.replace(gpt(**kwargs), layer_ranges=None)


def per_process(**kwargs: Any) -> Training:
    """The reference GPT whose data is shuffled at load time with a seed of its own process: a pure
    function within a process (every start-up check passes), another one in every process."""
    base = gpt(**kwargs)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(os.getpid()))

    def data(iteration: int, pipeline: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = base.data(iteration, pipeline, microbatch)
        return perm[tokens], perm[targets]

    return dataclasses.replace(base, data=data)


def hangs_once(hang_flag: str, **kwargs: Any) -> Training:
    """The reference GPT whose data function hangs for ever in the process that first reads micro-batch
    [1, 0] of iteration 2 while the file `hang_flag` exists (it removes it: a re-joiner does not hang)."""
    base = gpt(**kwargs)

    def data(iteration: int, pipeline: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (iteration, pipeline, microbatch) == (2, 1, 0):
            try:
                os.unlink(hang_flag)
            except FileNotFoundError:
                pass
            else:
                threading.Event().wait()  # a data loader that deadlocked
        return base.data(iteration, pipeline, microbatch)

    return dataclasses.replace(base, data=data)
