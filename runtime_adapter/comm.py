"""Process groups per schedule version, and waits that a membership change can interrupt.

Every schedule version gets fresh groups under its own store prefix (as torchft does): a world group
over all alive workers (point-to-point activations and gradients, the agreement on k, the global norm)
and one group over the alive peers of this worker's stage (the OPT all-reduce, state transfer on
re-join). The world group is always gloo, on CPU tensors: the executor posts its receives ahead and
matches them by tag, and a re-routed schedule receives from a peer in another order than the peer
sends, while NCCL matches point-to-point messages by order only (no tags). The stage group runs on the
requested backend (NCCL: the gradient all-reduce, the bulk of the bytes, on the GPUs). Survivors never
restart; the groups of older versions are destroyed by a `GroupReaper` once no collective can still
run on them. The store may die and be restarted empty: a version's rendezvous waits for it and runs in
attempts that every member agrees on (`recycle/v<version>/<attempt token>`, docs/runtime.md section
"The rendezvous store").

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
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from runtime_adapter import nccl
from runtime_adapter.assignment import Assignment, Worker
from runtime_adapter.backoff import Backoff
from runtime_adapter.store import connect as store_connect
from runtime_adapter.store import try_connect as store_try_connect

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


def connect_groups(
    store_addr: tuple[str, int],
    a: Assignment,
    interrupted: threading.Event,
    backend: str,
    timeout: timedelta,
    reaper: GroupReaper,
    superseded: Callable[[], bool],
    device: torch.device | None = None,
) -> Groups:
    """Build the groups of version `a` in a helper thread, giving up (Interrupted) as soon as
    `superseded()` (a newer version arrived): a member that skipped this version would otherwise keep
    everyone waiting until the timeout. Groups finished after giving up go to the reaper.

    The store may die and come back empty meanwhile (`recycle store`): the helper waits for it and
    runs the rendezvous in attempts (`_rendezvous`), all within `timeout`."""
    box: dict[str, Any] = {}
    done, lock, stop = threading.Event(), threading.Lock(), threading.Event()

    def target() -> None:
        try:
            groups = _rendezvous(store_addr, a, interrupted, backend, timeout, reaper, device, stop)
        except BaseException as e:
            box["error"] = e
            done.set()
            return
        with lock:
            box["groups"] = groups
            if "abandoned" in box:  # the worker moved on: nobody will use these
                reaper.retire(box.pop("groups"))
        done.set()

    threading.Thread(target=target, name=f"recycle-connect-v{a.version}", daemon=True).start()
    while not done.wait(POLL_S):
        if superseded():
            stop.set()
            with lock:
                box["abandoned"] = True
                if "groups" in box:
                    reaper.retire(box.pop("groups"))
            raise Interrupted(f"a version above v{a.version} arrived while connecting its groups")
    if "error" in box:
        raise box["error"]
    return box["groups"]


class RendezvousError(RuntimeError):
    """The groups of a version could not be built within the group timeout."""


ATTEMPT_POLL_S = (0.1, 1.0)  # a member that built its groups checks the attempt key: first, at most


def attempt_key(version: int) -> str:
    """The store key holding the token of version `version`'s current rendezvous attempt."""
    return f"recycle/v{version}/attempt"


def current_attempt(store: dist.Store, version: int, failed: str | None = None) -> str:
    """The token of `version`'s current rendezvous attempt; first retires `failed` (an attempt this
    member saw fail) if it is still current. compare_set makes every member agree: the first caller
    creates the token, the first one to retire an attempt names its successor, and a restarted, empty
    store gets a new token (no attempt of the old store is ever current on it)."""
    key, mine = attempt_key(version), uuid.uuid4().hex[:12]
    if failed is not None:
        token = store.compare_set(key, failed, mine).decode()
        if token != failed:  # replaced now, by us or by someone before us
            return token
        # else the key is absent (an empty store): create it below
    return store.compare_set(key, "", mine).decode()


def _rendezvous(
    store_addr: tuple[str, int],
    a: Assignment,
    interrupted: threading.Event,
    backend: str,
    timeout: timedelta,
    reaper: GroupReaper,
    device: torch.device | None,
    stop: threading.Event,
) -> Groups:
    """Version `a`'s groups, built under `recycle/v<version>/<attempt token>` and committed (every
    member built them). An attempt fails when the store dies during it (or any member's build fails):
    whoever sees it fail retires its token, and every member starts again from scratch under the
    successor's token (the members that had built the failed attempt's groups learn it from their
    commit all-reduce failing or from the store's key, and drop those groups). RendezvousError past
    `timeout`; StoreUnavailable/Interrupted once `stop` is set."""
    deadline = time.monotonic() + timeout.total_seconds()
    backoff = Backoff(0.05, 1.0)
    failed: str | None = None  # the newest attempt this member saw fail
    why = "no attempt finished"
    attempt = 0
    while True:
        if stop.is_set():
            raise Interrupted(f"gave up the rendezvous of v{a.version}")
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"groups of v{a.version} not built within {timeout.total_seconds():g} s ({why})"
            )
        token, groups = None, None
        try:
            # A store client of its own per attempt: an abandoned attempt may still block in a store
            # wait, one client serializes its requests, and a client of a store that died is dead.
            store = store_connect(store_addr, timeout, deadline, stop)
            token = current_attempt(store, a.version, failed)
            prefix = f"recycle/v{a.version}/{token}"
            groups = reaper.track(build_groups(store, a, interrupted, backend, timeout, device, prefix))
            if _commit(groups, store, store_addr, a.version, token, timeout, deadline, stop):
                if attempt:
                    logger.info("groups of v%d built at attempt %d (%s)", a.version, attempt + 1, token)
                return groups
            why = f"attempt {token} was abandoned by a member"
        except RuntimeError as e:  # DistError: the store died, a peer vanished, a timeout
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
        except BaseException:
            if groups is not None:
                reaper.retire(groups)
            raise
        if groups is not None:
            reaper.retire(groups)
        if token is not None:
            failed = token
        attempt += 1
        if stop.is_set():
            continue
        logger.warning("v%d: rendezvous attempt %s failed (%s): starting again", a.version, token, why)
        stop.wait(min(backoff.next(), max(0.0, deadline - time.monotonic())))


def _commit(
    groups: Groups,
    store: dist.Store,
    store_addr: tuple[str, int],
    version: int,
    token: str,
    timeout: timedelta,
    deadline: float,
    stop: threading.Event,
) -> bool:
    """True once an all-reduce over the new world group completed: every member built this attempt's
    groups, nobody will retire it. False when the attempt failed: the all-reduce failed (a member
    dropped its half-built groups), or the store's attempt key names another token (a member retired
    this one; read from the store that is up now, reconnecting if it died)."""
    t = torch.ones(1, dtype=torch.int64)
    work = groups.world.allreduce([t])
    poll_s = ATTEMPT_POLL_S[0]
    next_check = time.monotonic() + poll_s
    client: dist.Store | None = store
    while not work.is_completed():
        if stop.is_set():
            raise Interrupted(f"gave up the rendezvous of v{version}")
        now = time.monotonic()
        if now >= deadline:
            raise RendezvousError(f"groups of v{version}: not every member built them in time")
        if now >= next_check:
            if client is None:
                client = store_try_connect(store_addr, min(timeout, timedelta(seconds=5)))
            if client is not None:
                try:
                    if client.compare_set(attempt_key(version), token, token).decode() != token:
                        return False
                except RuntimeError:
                    client = None  # the store died: look for the restarted one next time
            poll_s = min(1.5 * poll_s, ATTEMPT_POLL_S[1])
            next_check = time.monotonic() + poll_s
        time.sleep(POLL_S)
    try:
        work.wait()
    except RuntimeError as e:
        logger.info("v%d: commit of attempt %s failed: %s", version, token, str(e).splitlines()[0])
        return False
    return True


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
