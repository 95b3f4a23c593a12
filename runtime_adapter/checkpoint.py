"""Periodic checkpoints: the fallback when a failure set is unrecoverable (a whole stage lost).

Every `every` stepped iterations, the lowest alive worker of each stage writes its stage's parameters,
optimizer state and stepped count to `<dir>/stage<s>/it<k>.pt` atomically (temporary file, fsync,
os.replace, fsync of the directory). The peers of a stage hold bitwise-equal state after every OPT,
so one copy per stage is enough. A checkpoint is usable only when every stage has a file for the same
iteration: `latest_complete` picks the newest such iteration (no manifest, so no coordination between
stages). Each writer keeps its stage's newest `KEEP` files.

A stage file written at stepped count k stays valid if its writer is later rolled back to k - 1: the
step it holds was taken on the gradient of the whole global batch (exactly-once is checked on every
step), so it is the state after k iterations whatever schedule replays iteration k - 1.
"""

from __future__ import annotations

import io
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

KEEP = 3
_NAME = re.compile(r"^it(\d+)\.pt$")


def stage_file(directory: Path, stage: int, iteration: int) -> Path:
    """The checkpoint file of `stage` after `iteration` stepped iterations."""
    return Path(directory) / f"stage{stage}" / f"it{iteration:08d}.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file, the new one, or none: never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_stage(
    directory: Path, stage: int, stepped: int, model: dict[str, Any], optim: dict[str, Any]
) -> Path:
    """Write one stage's state after `stepped` iterations; drop that stage's files beyond the newest KEEP."""
    buf = io.BytesIO()
    torch.save({"stage": stage, "stepped": stepped, "model": model, "optim": optim}, buf)
    path = stage_file(directory, stage, stepped)
    write_atomic(path, buf.getvalue())
    for old in sorted(stage_iterations(directory, stage))[:-KEEP]:
        stage_file(directory, stage, old).unlink(missing_ok=True)
    logger.info("checkpoint of stage %d at %d stepped iterations: %s", stage, stepped, path)
    return path


def stage_iterations(directory: Path, stage: int) -> set[int]:
    """The stepped counts stage `stage` has a (complete, renamed) checkpoint file for."""
    folder = Path(directory) / f"stage{stage}"
    if not folder.is_dir():
        return set()
    found = set()
    for p in folder.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.add(int(m.group(1)))
    return found


def latest_complete(directory: Path, num_stages: int) -> int | None:
    """The newest stepped count for which every stage has a checkpoint file, or None."""
    common: set[int] | None = None
    for s in range(num_stages):
        its = stage_iterations(directory, s)
        common = its if common is None else common & its
    return max(common) if common else None


def load_stage(directory: Path, stage: int, iteration: int) -> dict[str, Any]:
    """The saved state of `stage` after `iteration` stepped iterations: {stage, stepped, model, optim}."""
    state: dict[str, Any] = torch.load(
        stage_file(directory, stage, iteration), map_location="cpu", weights_only=True
    )
    if state["stage"] != stage or state["stepped"] != iteration:
        raise ValueError(
            f"{stage_file(directory, stage, iteration)}: holds stage {state['stage']} at {state['stepped']}"
        )
    return state
