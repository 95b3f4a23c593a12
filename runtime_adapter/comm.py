"""Process groups per schedule version, and waits that a membership change can interrupt.

Every schedule version gets fresh groups under its own store prefix (as torchft does): a world group
over all alive workers (point-to-point activations and gradients, the agreement on k, the global norm)
and one group over the alive peers of this worker's stage (the OPT all-reduce, state transfer on
re-join). The world group is always gloo, on CPU tensors: the executor posts its receives ahead and
matches them by tag, and a re-routed schedule receives from a peer in another order than the peer
sends, while NCCL matches point-to-point messages by order only (no tags). The stage group runs on the
requested backend (NCCL: the gradient all-reduce, the bulk of the bytes, on the GPUs). Survivors never
restart; the groups of older versions are destroyed by a `GroupReaper` once no collective can still
run on them. The groups of a version are connected by rendezvous.py (which survives a store restart).

A c10d wait cannot be cancelled (gloo's abort does not wake a blocked receive), so waits run in a
daemon thread and the caller gives up as soon as `interrupted` is set; the stuck wait ends with the
abandoned group's timeout. NCCL (nccl.py) differs: `work.wait()` does not block the host, so the
caller polls `work.is_completed()`, and retired NCCL groups are aborted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from runtime_adapter import nccl
from runtime_adapter.assignment import Assignment, Worker

logger = logging.getLogger(__name__)

POLL_S = 0.005
DONE_WAIT = timedelta(seconds=1)  # a wait on a completed NCCL work returns at once (or raises)


class Interrupted(Exception):
    """A newer schedule version arrived: drop the iteration in flight and recover."""


class Waiter:
    """Runs c10d `Work.wait()` calls in a daemon thread so the caller can stop waiting (gloo), or
    polls `Work.is_completed()` in the caller's thread (NCCL)."""

    def __init__(self, interrupted: threading.Event, backend: str = "gloo") -> None:
        self.interrupted = interrupted
        self.polls = backend == "nccl"
        self.errored: Callable[[], str | None] = lambda: None  # NCCL: nccl.error_probe of the groups
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
        if self.polls:
            self._poll(work, what)
            return
        done, errors = threading.Event(), list[BaseException]()
        self._jobs.put((work, done, errors))
        while not done.wait(POLL_S):
            if self.interrupted.is_set():
                raise Interrupted(f"interrupted while waiting for {what}")
        if errors:
            raise errors[0]

    def _poll(self, work: Any, what: str) -> None:
        # An NCCL work is complete once its kernel finished on the GPU (or it failed: timeout, abort),
        # which the host sees only by polling; spin briefly, then back off to POLL_S.
        delay = 5e-5
        while True:
            done, error = work.is_completed(), self.errored()
            if error is not None:  # the watchdog saw a timeout or an NCCL error (then aborts)
                raise dist.DistBackendError(f"{what}: NCCL {error}")
            if done:
                break
            if self.interrupted.is_set():
                raise Interrupted(f"interrupted while waiting for {what}")
            time.sleep(delay)
            delay = min(2 * delay, POLL_S)
        # Complete. Only a wait with a timeout makes WorkNCCL check the work's error (and rethrow it
        # here); it also orders this thread's current stream after the kernel, which has finished:
        # the result is visible to the host and to every later kernel without a device synchronize.
        work.wait(DONE_WAIT)

    def close(self) -> None:
        """Let the thread end once its current wait (if any) returns."""
        self._jobs.put(None)


def make_group(
    store: dist.Store,
    rank: int,
    size: int,
    backend: str,
    timeout: timedelta,
    device: torch.device | None = None,
) -> Any:
    """A process group of `size` ranks on `store` (gloo on CPU, NCCL on `device`, a GPU: same calls
    after this; nccl.make_nccl_group sets the process's NCCL environment before the first one)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        return nccl.make_nccl_group(store, rank, size, timeout, device or torch.device("cuda"))
    raise ValueError(f"backend must be gloo or nccl, not {backend!r}")


@dataclass
class Groups:
    """The groups of one schedule version as seen by one worker."""

    version: int
    world: Any
    world_rank: dict[Worker, int]
    stage: Any
    stage_rank: dict[Worker, int]
    waiter: Waiter  # the world group's waits (gloo)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the stage group's tensors
    backend: str = "gloo"  # the stage group's backend (the world group is gloo)
    stage_waiter: Waiter | None = None  # the stage group's waits when they differ (NCCL: polling)

    @property
    def stage_waits(self) -> Waiter:
        """The waiter for work on the stage group."""
        return self.stage_waiter or self.waiter

    def close(self) -> None:
        """Abandon these groups (gloo: their stuck waits end with their timeout)."""
        self.waiter.close()
        if self.stage_waiter is not None:
            self.stage_waiter.close()


def build_groups(
    store: dist.Store,
    a: Assignment,
    interrupted: threading.Event,
    backend: str = "gloo",
    timeout: timedelta = timedelta(seconds=30),
    device: torch.device | None = None,
    prefix: str | None = None,
) -> Groups:
    """Connect this worker's world and stage groups for version `a.version` (blocks until all join)
    under store prefix `prefix` (default `recycle/v<version>`)."""
    alive = a.alive_workers()
    world_rank = {w: i for i, w in enumerate(alive)}
    stage_rank = {w: i for i, w in enumerate(a.stage_alive)}
    prefix, device = prefix or f"recycle/v{a.version}", device or torch.device("cpu")
    world = make_group(
        dist.PrefixStore(f"{prefix}/world", store), world_rank[a.worker], len(alive), "gloo", timeout
    )
    stage = make_group(
        dist.PrefixStore(f"{prefix}/stage{a.worker[1]}", store),
        stage_rank[a.worker],
        len(a.stage_alive),
        backend,
        timeout,
        device,
    )
    logger.info("groups of v%d: world %d ranks, stage %d peers", a.version, len(alive), len(a.stage_alive))
    stage_waiter = None
    if backend == "nccl":
        stage_waiter = Waiter(interrupted, backend)
        stage_waiter.errored = nccl.error_probe((stage,), ("stage",))
    return Groups(
        a.version, world, world_rank, stage, stage_rank, Waiter(interrupted), device, backend, stage_waiter
    )


def broadcast_bytes(groups: Groups, data: bytes | None, src_rank: int) -> bytes:
    """Broadcast a byte string over the stage group from `src_rank` (state transfer on re-join)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src_rank
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=groups.device)
    groups.stage_waits.wait(groups.stage.broadcast([size], opts), "state size broadcast")
    payload = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(groups.device)
        if data is not None
        else torch.empty(int(size.item()), dtype=torch.uint8, device=groups.device)
    )
    groups.stage_waits.wait(groups.stage.broadcast([payload], opts), "state broadcast")
    return payload.cpu().numpy().tobytes()


def allreduce_min(groups: Groups, values: list[int], on_stage: bool = False) -> list[int]:
    """Element-wise minimum of `values` over the world (or stage) group."""
    t = torch.tensor(values, dtype=torch.int64, device=groups.device if on_stage else None)
    pg = groups.stage if on_stage else groups.world
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
    waiter = groups.stage_waits if on_stage else groups.waiter
    waiter.wait(pg.allreduce([t], opts), "agreement all-reduce")
    return [int(x) for x in t.tolist()]


class GroupReaper:
    """Destroys the groups of old versions in a daemon thread.

    The groups are not registered with c10d's default world (`dist.destroy_process_group` refuses
    them): a group is destroyed when its last reference goes (NCCL groups are aborted first, so no
    kernel, stream or watchdog stays blocked), and gloo's destructor waits for the operations still
    pending on it. Those end at once when the peer died (its sockets are closed) but
    only with the group timeout when the peer is alive and silent, so the reaper, not the training
    thread, drops the references. `live()` counts the process groups not yet destroyed (weak refs).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Groups | None] = queue.SimpleQueue()
        self._lock = threading.RLock()  # a finalizer may run in any thread, even one holding it
        self._live = 0
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._loop, name="recycle-reaper", daemon=True)
        self._thread.start()

    def track(self, groups: Groups) -> Groups:
        """Count `groups`' process groups as live until they are destroyed."""
        for pg in (groups.world, groups.stage):
            with self._lock:
                self._live += 1
            weakref.finalize(pg, self._destroyed)
        return groups

    def _destroyed(self) -> None:
        with self._lock:
            self._live -= 1

    def live(self) -> int:
        """Process groups built (and tracked) and not yet destroyed."""
        with self._lock:
            return self._live

    def retire(self, groups: Groups) -> None:
        """Hand over `groups`: nobody may use them any more (the caller drops its references)."""
        with self._lock:
            self._pending += 1
        self._queue.put(groups)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every retired group was destroyed; False after `timeout_s`."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def _loop(self) -> None:
        while True:
            groups = self._queue.get()
            if groups is None:
                return
            groups.close()
            world, stage = groups.world, groups.stage
            groups.world = groups.stage = None  # the Groups object may outlive this: drop its refs
            try:
                if groups.backend == "nccl":
                    nccl.abort_groups([stage])  # before the references go (the world group is gloo)
                del world, stage  # gloo's destructor: joins its threads, closes its sockets
            except BaseException as e:  # never let the reaper die
                logger.warning("destroying the groups of v%d: %s", groups.version, e)
            logger.info("groups of v%d destroyed", groups.version)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
