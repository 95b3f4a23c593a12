"""Connecting a schedule version's groups through a rendezvous store that may die.

`connect_groups` builds version v's groups (comm.build_groups) in a helper thread that a newer version
can abandon. The store may die and be restarted empty meanwhile (`recycle store`): the helper waits
for it and runs the rendezvous in attempts that every member agrees on, under
`recycle/v<version>/<attempt token>` (docs/runtime.md, "The rendezvous store"):

1. each member reads (or, the first, creates) the attempt token with an atomic `compare_set`;
2. builds the world and stage groups under that token's prefix;
3. commits with a one-element all-reduce over the new world group, which completes only if every
   member built that attempt's groups;
4. a member that sees an attempt fail (its build or commit failed, the store died) retires the token
   with `compare_set(key, old, new)`, so all members agree on its successor; a restarted, empty store
   never has an old token current.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from runtime_adapter.assignment import Assignment
from runtime_adapter.backoff import Backoff
from runtime_adapter.comm import POLL_S, GroupReaper, Groups, Interrupted, build_groups
from runtime_adapter.store import connect as store_connect
from runtime_adapter.store import try_connect as store_try_connect

logger = logging.getLogger(__name__)


def connect_groups(
    store_addr: tuple[str, int],
    a: Assignment,
    interrupted: threading.Event,
    backend: str,
    timeout: timedelta,
    reaper: GroupReaper,
    superseded: Callable[[], bool],
    device: torch.device | None = None,
    run: str = "",
    patience: timedelta | None = None,
) -> Groups:
    """Build the groups of version `a` in a helper thread, giving up (Interrupted) as soon as
    `superseded()` (a newer version arrived): a member that skipped this version would otherwise keep
    everyone waiting until the timeout. Groups finished after giving up go to the reaper.

    The store may die and come back empty meanwhile (`recycle store`), and a member may come late (a
    re-joiner still starting): the helper waits for the store and runs the rendezvous in attempts
    (`_rendezvous`), each build within `timeout`, a new attempt started until `patience` (default:
    `timeout`) has passed."""
    box: dict[str, Any] = {}
    done, lock, stop = threading.Event(), threading.Lock(), threading.Event()

    def target() -> None:
        try:
            root = f"recycle/{run}" if run else "recycle"
            groups = _rendezvous(
                store_addr, a, interrupted, backend, timeout, reaper, device, stop, root, patience or timeout
            )
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


def attempt_key(version: int, root: str = "recycle") -> str:
    """The store key holding the token of version `version`'s current rendezvous attempt (`root`:
    `recycle/<run id>`, so that jobs and runs sharing a long-lived store never meet)."""
    return f"{root}/v{version}/attempt"


def current_attempt(store: dist.Store, version: int, failed: str | None = None, root: str = "recycle") -> str:
    """The token of `version`'s current rendezvous attempt; first retires `failed` (an attempt this
    member saw fail) if it is still current. compare_set makes every member agree: the first caller
    creates the token, the first one to retire an attempt names its successor, and a restarted, empty
    store gets a new token (no attempt of the old store is ever current on it)."""
    key, mine = attempt_key(version, root), uuid.uuid4().hex[:12]
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
    root: str = "recycle",
    patience: timedelta | None = None,
) -> Groups:
    """Version `a`'s groups, built under `recycle/v<version>/<attempt token>` and committed (every
    member built them). An attempt fails when the store dies during it or a member's build fails or
    times out (a member still starting): whoever sees it fail retires its token, and every member
    starts again from scratch under the successor's token (the members that had built the failed
    attempt's groups learn it from their commit all-reduce failing or from the store's key, and drop
    those groups). RendezvousError past `patience` (default `timeout`); StoreUnavailable/Interrupted
    once `stop` is set."""
    patience = patience or timeout
    deadline = time.monotonic() + patience.total_seconds()
    backoff = Backoff(0.05, 1.0)
    failed: str | None = None  # the newest attempt this member saw fail
    why = "no attempt finished"
    attempt = 0
    while True:
        if stop.is_set():
            raise Interrupted(f"gave up the rendezvous of v{a.version}")
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"groups of v{a.version} not built within {patience.total_seconds():g} s ({why})"
            )
        token, groups = None, None
        try:
            # A store client of its own per attempt: an abandoned attempt may still block in a store
            # wait, one client serializes its requests, and a client of a store that died is dead.
            store = store_connect(store_addr, timeout, deadline, stop)
            token = current_attempt(store, a.version, failed, root)
            prefix = f"{root}/v{a.version}/{token}"
            groups = reaper.track(build_groups(store, a, interrupted, backend, timeout, device, prefix))
            if _commit(
                groups, store, store_addr, attempt_key(a.version, root), token, timeout, deadline, stop
            ):
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
    key: str,
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
            raise Interrupted(f"gave up the rendezvous of {key}")
        now = time.monotonic()
        if now >= deadline:
            raise RendezvousError(f"groups of {key}: not every member built them in time")
        if now >= next_check:
            if client is None:
                client = store_try_connect(store_addr, min(timeout, timedelta(seconds=5)))
            if client is not None:
                try:
                    if client.compare_set(key, token, token).decode() != token:
                        return False
                except RuntimeError:
                    client = None  # the store died: look for the restarted one next time
            poll_s = min(1.5 * poll_s, ATTEMPT_POLL_S[1])
            next_check = time.monotonic() + poll_s
        time.sleep(POLL_S)
    try:
        work.wait()
    except RuntimeError as e:
        logger.info("%s: commit of attempt %s failed: %s", key, token, str(e).splitlines()[0])
        return False
    return True
