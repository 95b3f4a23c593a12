"""Periodic checkpoints: the fallback when a failure set is unrecoverable (a whole stage lost).

Every `every` stepped iterations, the lowest alive worker of each stage saves its stage's parameters,
optimizer state and stepped count with torch.distributed.checkpoint (DCP) to
`<root>/stage<s>/it<k>/`, where root is a directory every host can read or an fsspec URL
(checkpoint_io.py). The peers of a stage hold bitwise-equal state after every OPT, so one copy per
stage is enough. The save is asynchronous (`Checkpointer`): `save` copies the tensors (the training
loop may change them right after) and returns; a background thread writes the DCP files, then the
marker `<root>/stage<s>/it<k>/complete` last, then calls `on_done(k)`. Only a directory with its
marker is a checkpoint: a writer killed mid-save leaves none (its leftovers are removed by the next
save of that stage). A checkpoint is usable when every stage has one for the same iteration:
`latest_complete` picks the newest such iteration (no manifest, so no coordination between stages).
Each writer keeps its stage's newest `KEEP`.

What DCP stores is flat (checkpoint_state.py: `stage_state` and its inverse `unstage`): one tensor
per state tensor plus the `skeleton` of {stage, stepped, model, optim}, so that a plain torch.optim
state dict comes back exactly as it was.

A stage checkpoint written at stepped count k stays valid if its writer is later rolled back to k - 1:
the step it holds was taken on the gradient of the whole global batch (exactly-once is checked on
every step), so it is the state after k iterations whatever schedule replays iteration k - 1. A save
at a k that already has a complete checkpoint is therefore skipped (and reported done).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from runtime_adapter.checkpoint_io import Root
from runtime_adapter.checkpoint_state import stage_state, unstage

logger = logging.getLogger(__name__)

KEEP = 3
MARKER = "complete"
_NAME = re.compile(r"^it(\d+)$")
RootLike = str | os.PathLike[str]


def _rel(stage: int, iteration: int | None = None) -> list[str]:
    return [f"stage{stage}"] if iteration is None else [f"stage{stage}", f"it{iteration:08d}"]


def stage_dir(root: RootLike, stage: int, iteration: int) -> str:
    """The checkpoint directory (path or URL) of `stage` after `iteration` stepped iterations."""
    r = Root(root)
    return (
        r.path(*_rel(stage, iteration))
        if not r.url
        else r.fs.unstrip_protocol(r.path(*_rel(stage, iteration)))
    )


# -- writing -------------------------------------------------------------------------------------------


def write_staged(root: RootLike, stage: int, stepped: int, staged: dict[str, torch.Tensor]) -> str:
    """Write a staged state as stage `stage`'s checkpoint at `stepped`, marker last; drop that stage's
    checkpoints beyond the newest KEEP. The checkpoint directory."""
    r = Root(root)
    folder = r.path(*_rel(stage, stepped))
    marker = f"{folder}/{MARKER}"
    if r.exists(marker):  # the same state (see the module doc): keep the durable copy untouched
        logger.info("checkpoint of stage %d at %d exists already: not rewritten", stage, stepped)
        return folder
    r.remove(folder)  # a torn earlier attempt
    t0 = time.monotonic()
    r.save_tensors(folder, staged)
    r.write_small(marker, f'{{"stage": {stage}, "stepped": {stepped}}}\n'.encode())
    logger.info("checkpoint of stage %d at %d stepped iterations: %s (%.2f s)", stage, stepped, folder,
                time.monotonic() - t0)  # fmt: skip
    try:
        _retain(r, stage)
    except OSError as e:  # the new checkpoint is durable; a failed clean-up only costs space
        logger.warning("checkpoints of stage %d: clean-up failed (%s)", stage, e)
    return folder


def save_stage(root: RootLike, stage: int, stepped: int, model: dict[str, Any], optim: dict[str, Any]) -> str:
    """Synchronous save (copy, write, marker): the checkpoint directory."""
    return write_staged(root, stage, stepped, stage_state(stage, stepped, model, optim))


def _retain(r: Root, stage: int) -> None:
    """Keep the newest KEEP complete checkpoints of `stage`; delete older ones and torn leftovers
    below the newest complete one (the marker first, so a half-deleted one is never complete)."""
    folder = r.path(*_rel(stage))
    complete = sorted(_complete(r, stage))
    if not complete:
        return
    keep = set(complete[-KEEP:])
    for name in r.names(folder):
        m = _NAME.match(name)
        if m and int(m.group(1)) not in keep and int(m.group(1)) < complete[-1]:
            r.remove(f"{folder}/{name}/{MARKER}")
            r.remove(f"{folder}/{name}")


class Checkpointer:
    """Asynchronous saves to one root: `save` returns once the state is copied; the write runs in a
    background thread, one at a time (a save first waits for the previous one). A failed write is
    logged (one line) and not reported done: training goes on without that checkpoint. With
    `reuse_buffers` the copy of one save is kept and overwritten by the next (one more copy of the
    state stays in host memory; the copy, i.e. the training loop's stall, is several times faster)."""

    def __init__(self, root: RootLike, reuse_buffers: bool = True) -> None:
        self.root = root
        self.reuse_buffers = reuse_buffers
        self._staged: dict[str, torch.Tensor] | None = None
        self._thread: threading.Thread | None = None
        self.failures = 0  # writes that failed

    def save(
        self,
        stage: int,
        stepped: int,
        model: dict[str, Any],
        optim: dict[str, Any],
        on_done: Callable[[int], None] | None = None,
    ) -> None:
        """Copy the state now, write it in the background, call `on_done(stepped)` once durable."""
        self.wait()
        staged = stage_state(stage, stepped, model, optim, self._staged)
        self._staged = staged if self.reuse_buffers else None
        self._thread = threading.Thread(
            target=self._write, args=(stage, stepped, staged, on_done), name=f"checkpoint-{stage}-{stepped}"
        )
        self._thread.start()

    def _write(
        self, stage: int, stepped: int, staged: dict[str, torch.Tensor], on_done: Callable[[int], None] | None
    ) -> None:
        try:
            write_staged(self.root, stage, stepped, staged)
        except Exception as e:
            self.failures += 1
            logger.error(
                "checkpoint of stage %d at %d not written: %s", stage, stepped, f"{type(e).__name__}: {e}"
            )
            return
        if on_done is not None:
            try:
                on_done(stepped)
            except Exception:
                logger.exception("checkpoint of stage %d at %d: on_done failed", stage, stepped)

    @property
    def pending(self) -> bool:
        """Whether a write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the running write (if any); False if it is still running after `timeout` s."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    def close(self) -> None:
        """Wait for the running write."""
        self.wait()


# -- reading -------------------------------------------------------------------------------------------


def _complete(r: Root, stage: int) -> set[int]:
    folder = r.path(*_rel(stage))
    found = set()
    for name in r.names(folder):
        m = _NAME.match(name)
        if m and r.exists(f"{folder}/{name}/{MARKER}"):
            found.add(int(m.group(1)))
    return found


def stage_iterations(root: RootLike, stage: int) -> set[int]:
    """The stepped counts stage `stage` has a complete checkpoint (marker present) for."""
    return _complete(Root(root), stage)


def latest_complete(root: RootLike, num_stages: int) -> int | None:
    """The newest stepped count for which every stage has a complete checkpoint, or None."""
    r = Root(root)
    common: set[int] | None = None
    for s in range(num_stages):
        its = _complete(r, s)
        common = its if common is None else common & its
        if not common:
            return None
    return max(common) if common else None


def has_checkpoints(root: RootLike) -> bool:
    """Whether `root` holds any stage checkpoint directory (complete or not)."""
    r = Root(root)
    return any(
        _NAME.match(name)
        for stage in r.names(r.base)
        if stage.startswith("stage")
        for name in r.names(r.path(stage))
    )


def load_stage(root: RootLike, stage: int, iteration: int) -> dict[str, Any]:
    """The saved state of `stage` after `iteration` stepped iterations: {stage, stepped, model, optim}
    (tensors on the CPU). FileNotFoundError if that checkpoint is not complete."""
    r = Root(root)
    folder = r.path(*_rel(stage, iteration))
    if not r.exists(f"{folder}/{MARKER}"):
        raise FileNotFoundError(f"{stage_dir(root, stage, iteration)}: no complete checkpoint")
    state = unstage(r.load_tensors(folder))
    if state["stage"] != stage or state["stepped"] != iteration:
        raise ValueError(
            f"{stage_dir(root, stage, iteration)}: holds stage {state['stage']} at {state['stepped']}"
        )
    return state
