"""Process groups per schedule version, and waits that a membership change can interrupt.

Every schedule version gets fresh groups under its own store prefix (as torchft does): a world group
over all alive workers (point-to-point activations and gradients) and one group over the alive peers of
this worker's stage (the OPT all-reduce, state transfer on re-join). Survivors never restart; the
groups of older versions are simply abandoned.

A c10d wait cannot be cancelled (gloo's abort does not wake a blocked receive), so waits run in a
daemon thread and the caller gives up as soon as `interrupted` is set; the stuck wait ends with the
abandoned group's timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from runtime_adapter.assignment import Assignment, Worker

logger = logging.getLogger(__name__)

POLL_S = 0.005


class Interrupted(Exception):
    """A newer schedule version arrived: drop the iteration in flight and recover."""


class Waiter:
    """Runs c10d `Work.wait()` calls in a daemon thread so the caller can stop waiting."""

    def __init__(self, interrupted: threading.Event) -> None:
        self.interrupted = interrupted
        self._jobs: queue.SimpleQueue[tuple[Any, threading.Event, list[BaseException]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name="recycle-waiter", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            work, done, errors = job
            try:
                work.wait()
            except BaseException as e:
                errors.append(e)
            done.set()

    def wait(self, work: Any, what: str) -> None:
        """Wait for `work`; raise Interrupted when a new version arrives first, or the work's error."""
        done, errors = threading.Event(), list[BaseException]()
        self._jobs.put((work, done, errors))
        while not done.wait(POLL_S):
            if self.interrupted.is_set():
                raise Interrupted(f"interrupted while waiting for {what}")
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Let the thread end once its current wait (if any) returns."""
        self._jobs.put(None)


def make_group(store: dist.Store, rank: int, size: int, backend: str, timeout: timedelta) -> Any:
    """A process group of `size` ranks on `store` (gloo on CPU, NCCL on GPUs: same calls after this)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"backend must be gloo or nccl, not {backend!r}")


@dataclass
class Groups:
    """The groups of one schedule version as seen by one worker."""

    version: int
    world: Any
    world_rank: dict[Worker, int]
    stage: Any
    stage_rank: dict[Worker, int]
    waiter: Waiter
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def close(self) -> None:
        """Abandon these groups (their stuck waits end with their timeout)."""
        self.waiter.close()


def build_groups(
    store: dist.Store,
    a: Assignment,
    interrupted: threading.Event,
    backend: str = "gloo",
    timeout: timedelta = timedelta(seconds=30),
    device: torch.device | None = None,
) -> Groups:
    """Connect this worker's world and stage groups for version `a.version` (blocks until all join)."""
    alive = a.alive_workers()
    world_rank = {w: i for i, w in enumerate(alive)}
    stage_rank = {w: i for i, w in enumerate(a.stage_alive)}
    prefix = f"recycle/v{a.version}"
    world = make_group(
        dist.PrefixStore(f"{prefix}/world", store), world_rank[a.worker], len(alive), backend, timeout
    )
    stage = make_group(
        dist.PrefixStore(f"{prefix}/stage{a.worker[1]}", store),
        stage_rank[a.worker],
        len(a.stage_alive),
        backend,
        timeout,
    )
    logger.info("groups of v%d: world %d ranks, stage %d peers", a.version, len(alive), len(a.stage_alive))
    return Groups(
        a.version, world, world_rank, stage, stage_rank, Waiter(interrupted), device or torch.device("cpu")
    )
