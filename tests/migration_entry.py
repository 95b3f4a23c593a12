"""A test entry point (`--entry tests.migration_entry:training`): the reference GPT whose stage builder
kills its own process (SIGKILL, like --fail-at) when worker [d, s] builds layers [a, b) for a
migration (`die_building: [d, s, a, b]`): a worker dies in the middle of a layer migration, after its
sends and receives completed and before the commit all-reduce (migration.py builds the new module
then). `--fail-at K:MIGRATE` kills before any tensor moves, and only at an iteration known in advance;
the move back of tests/test_runtime_migration.py happens at an iteration that depends on when the
re-joiner came, hence this entry (tests/test_runtime_migration.py).

`die_switching: [d, s, a, b]` kills worker [d, s] when it switches to its new module for layers
[a, b): after the commit all-reduce completed (every peer may switch), before its own switch (the
optimizer of the new module is being built): a death inside the commit that leaves a moved layer
without a live holder (tests/test_runtime_migration_lost.py)."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from runtime_adapter import model


def _is_worker(d: int, s: int) -> bool:
    argv = sys.argv
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--pipeline", "--stage")}
    return flag.get("--pipeline") == str(d) and flag.get("--stage") == str(s)


def training(
    die_building: list[int] | None = None, die_switching: list[int] | None = None, **kwargs: Any
) -> model.Training:
    t = model.training(**kwargs)
    ranges = t.layer_ranges
    aim = die_building or die_switching
    if aim is None or ranges is None:
        return t
    d, s, a, b = aim
    armed = []  # die_switching: the new module was built; the next optimizer is its switch

    def build(stage: int, num_stages: int, layers: range) -> nn.Module:
        on_meta = torch.empty(0).device.type == "meta"  # the start-up checks, not a migration
        if _is_worker(d, s) and (layers.start, layers.stop) == (a, b) and not on_meta:
            if die_building is not None:
                os.kill(os.getpid(), signal.SIGKILL)
            armed.append(True)
        return ranges.build(stage, num_stages, layers)

    def optimizer(params: list[nn.Parameter]) -> Any:
        if armed:
            os.kill(os.getpid(), signal.SIGKILL)
        return t.optimizer(params)

    return replace(t, layer_ranges=replace(ranges, build=build), optimizer=optimizer)
