"""NCCL process groups that a membership change can abandon without taking the process down.

What is different from gloo (comm.py keeps the calls the same):

* A dead or silent peer leaves an NCCL kernel spinning on the GPU, and `work.wait()` does not block
  the host (it only orders the caller's stream after the kernel), so a hang would surface later in
  some unrelated CUDA call that nothing can interrupt. `comm.Waiter` therefore polls
  `work.is_completed()` on the host for NCCL and gives up when a new version arrives.
* Retired groups are aborted (`ProcessGroupNCCL.abort()`: `ncclCommAbort` on every communicator of
  the group, the stuck kernels exit, the watchdog thread ends) before their references are dropped,
  as torchft's `ProcessGroupWrapper.abort` does (torchft/process_group.py).
* Communicators are created non-blocking (`config.blocking = 0`, as torchft's `ProcessGroupNCCL`)
  and eagerly, on the connect thread of `rendezvous.connect_groups` (which a new version can abandon),
  not lazily in the first operation of the training thread. Only the stage group (the gradient
  all-reduce, state broadcast) is NCCL: point-to-point stays on the gloo world group (comm.py),
  because NCCL runs send/recv in issue order and matches them without tags.
* Process environment (read by ProcessGroupNCCL's constructor or once per process, so it is set
  before the first NCCL group; a value the user set is kept, with a warning when it can kill a
  survivor):
  - TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly). torch's default 3 (SkipCleanUp) makes the
    watchdog rethrow a collective timeout, which terminates the process: a survivor would die when
    an op of an abandoned version's group (whose peer died) reaches the group timeout before the
    reaper aborted it. With 2 the watchdog marks the group failed (`get_error()`, which the waiter
    checks: see `error_probe`), aborts its communicators, and the process lives on.
  - TORCH_NCCL_DUMP_ON_TIMEOUT=0. Otherwise any timeout writes a flight-recorder dump key to the
    shared TCPStore and the heartbeat monitor of the first NCCL group of every process on that store
    (and of every process started later: the key stays) terminates its process once the dump is
    done, whatever the error handling mode.
  - TORCH_NCCL_NONBLOCKING_TIMEOUT=<group timeout, s>: how long a non-blocking communicator init may
    take (torch's default is 30 min; torchft sets it to its timeout too).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# value, and the values that tear the process down on a timeout (warned about when set by the user)
ENV: dict[str, tuple[str, tuple[str, ...]]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("2", ("1", "3")),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("0", ("1", "true", "True")),
}
NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
_env_lock = threading.Lock()
_env_done = False


def configure_env(timeout: timedelta) -> None:
    """Set the NCCL environment above, once per process (before the first NCCL group is built:
    no NCCL thread reads the environment while it changes)."""
    global _env_done
    with _env_lock:
        if _env_done:
            return
        for name, (value, fatal) in ENV.items():
            if name not in os.environ:
                os.environ[name] = value
            elif os.environ[name] in fatal:
                logger.warning(
                    "%s=%s: an NCCL timeout on an abandoned version's group will end this process "
                    "(recycle sets %s when unset)",
                    name,
                    os.environ[name],
                    value,
                )
        os.environ.setdefault(NONBLOCKING_TIMEOUT, str(int(max(1.0, timeout.total_seconds()))))
        _env_done = True


def make_nccl_group(store: dist.Store, rank: int, size: int, timeout: timedelta, device: torch.device) -> Any:
    """An NCCL group of `size` ranks on `device`, its communicator connected now (blocks until every
    rank joined, at most about `timeout`)."""
    if not dist.is_nccl_available():
        raise RuntimeError("backend nccl: this torch build has no NCCL")
    if device.type != "cuda":
        raise ValueError(f"backend nccl needs a CUDA device, not {device}")
    configure_env(timeout)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout  # the watchdog's per-op timeout (harmless with CleanUpOnly)
    opts.config.blocking = 0  # non-blocking communicator: init and abort cannot hang forever
    pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    pg._set_sequence_number_for_group()  # as torch.distributed._dist2's NCCL factory
    pg.eager_connect_single_device(device)
    return pg


def error_probe(pgs: Iterable[Any], names: Iterable[str] = ("world", "stage")) -> Callable[[], str | None]:
    """A check of `pgs`' error state (`get_error()`, set by the watchdog on a timeout or NCCL error):
    "world: TIMEOUT" or None. A work of an aborted communicator looks completed (its kernel exited),
    so a completed work is trusted only while its groups are fine. Weak references: the probe lives in
    the waiter and must not keep retired groups alive."""
    refs = [(name, weakref.ref(pg)) for name, pg in zip(names, pgs, strict=False)]

    def probe() -> str | None:
        for name, ref in refs:
            pg = ref()
            error = getattr(pg.get_error(), "name", "SUCCESS") if pg is not None else "destroyed"
            if error != "SUCCESS":
                return f"{name} group: {error}"
        return None

    return probe


def abort_groups(pgs: Iterable[Any]) -> None:
    """Abort the communicators of `pgs` (duck-typed: anything with `abort()`), together.

    Inside one NCCL group call when the backend offers one (`_group_start`/`_group_end`), as
    `torch.distributed._abort_process_group` does: aborting communicators one by one can deadlock
    when a stuck kernel of the other one keeps the device busy (pytorch/pytorch#119797). Errors are
    logged, never raised: the caller is a reaper that must not die."""
    unique = list({id(pg): pg for pg in pgs if pg is not None}.values())
    if not unique:
        return
    first, grouped = unique[0], False
    if hasattr(first, "_group_start") and hasattr(first, "_group_end"):
        try:
            first._group_start()
            grouped = True
        except Exception as e:  # abort them one by one then
            logger.warning("starting an NCCL abort group: %s", str(e))
    try:
        for pg in unique:
            try:
                pg.abort()
            except Exception as e:
                logger.warning("aborting an NCCL group: %s", str(e))  # str: no traceback keeps it alive
    finally:
        if grouped:
            try:
                first._group_end()
            except Exception as e:
                logger.warning("ending the NCCL abort group: %s", str(e))
