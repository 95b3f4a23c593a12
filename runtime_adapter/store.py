"""The rendezvous store as a process of its own (`recycle store`), and store clients that survive its
restart.

`recycle store --host H --port P` hosts a `torch.distributed.TCPStore` server on a socket it binds
itself to H:P (only that address: the store has no authentication) until SIGTERM or SIGINT. The
store holds nothing that outlives a rendezvous: each schedule version's groups live under their own
prefix (`recycle/v<version>/<attempt>`, comm.py) and once connected they never use the store again.
So a store that dies only delays the next rendezvous: restart an empty one on the same address and
the next version's groups are built there (`rendezvous.connect_groups` waits for it, within the group
timeout, and a rendezvous the death interrupted is started again by every member).

Clients: `connect` waits (a plain TCP probe with jittered backoff, so a dead store does not fill the
logs with c10d's retry traces) until the address accepts connections, then opens a TCPStore client;
`StoreClient` is the launcher's client (warm standbys' keys), which reconnects after a restart;
`check_reachable` is `recycle launch --store`'s check before anything starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import TYPE_CHECKING

from runtime_adapter.backoff import Backoff

if TYPE_CHECKING:
    import argparse

    import torch.distributed as dist

logger = logging.getLogger(__name__)

PROBE_S = 0.5  # one TCP connect attempt
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.05, 0.5  # between connect attempts while the store is away
STORE_TIMEOUT = timedelta(seconds=60)  # the server's own client (it never waits on keys)


class StoreUnavailable(RuntimeError):
    """No store accepted a connection at the address before the deadline."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on exactly `host`:`port` (port 0: a free one); ValueError with a one-line
    reason (port out of range, unknown host, address in use or not local)."""
    if not 0 <= port < 65536:
        raise ValueError(f"port {port}: expected 0 (any free port) or 1..65535")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"host {host!r}: {getattr(e, 'strerror', None) or e}") from e
    sock = socket.socket(family, kind, proto)
    # SO_REUSEADDR: a store restarted on the port of one that was killed binds although the old
    # connections linger in TIME_WAIT (it still refuses a port another process listens on).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e})") from e
    return sock


def serve(
    host: str,
    port: int,
    stop: threading.Event,
    ready: Callable[[str, int], None] | None = None,
) -> None:
    """Host a TCPStore server on `host`:`port` until `stop` is set; `ready(host, port)` once it
    listens (the port chosen when `port` is 0). ValueError (one line) when it cannot listen there."""
    sock = bind(host, port)  # bad input fails before torch is imported

    import torch.distributed as dist

    bound = int(sock.getsockname()[1])
    fd = sock.detach()  # the server owns the socket from now on (and closes it)
    try:
        server = dist.TCPStore(
            host,
            bound,
            is_master=True,
            wait_for_workers=False,
            timeout=STORE_TIMEOUT,
            master_listen_fd=fd,
        )
    except RuntimeError as e:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise ValueError(f"cannot host a store on {host}:{bound} ({str(e).splitlines()[0]})") from e
    if ready is not None:
        ready(host, bound)
    stop.wait()
    del server


def cmd_store(args: argparse.Namespace) -> int:
    """`recycle store`: print `store listening on HOST:PORT`, serve until SIGTERM/SIGINT (exit 0);
    bad input (port out of range, address in use) is one line on stderr and exit 2."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def ready(host: str, port: int) -> None:
        print(f"store listening on {host}:{port}", flush=True)
        logger.info("store on %s:%d: SIGTERM or SIGINT stops it", host, port)

    try:
        serve(args.host, args.port, stop, ready)
    except ValueError as e:
        print(f"recycle store: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def probe(host: str, port: int, timeout_s: float = PROBE_S) -> str | None:
    """None if `host`:`port` accepts a TCP connection now, else why not (one line)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def connect(
    addr: tuple[str, int],
    timeout: timedelta,
    deadline: float | None = None,
    stop: threading.Event | None = None,
) -> dist.TCPStore:
    """A TCPStore client of the store at `addr` (its waits time out after `timeout`, at most what is
    left until `deadline`), waiting with jittered backoff until the store accepts connections.
    StoreUnavailable past `deadline` (time.monotonic(); default now + timeout) or once `stop` is set."""
    import torch.distributed as dist

    host, port = addr
    end = time.monotonic() + timeout.total_seconds() if deadline is None else deadline
    backoff, why = Backoff(BACKOFF_BASE_S, BACKOFF_CAP_S), "not tried"
    while True:
        if stop is not None and stop.is_set():
            raise StoreUnavailable(f"gave up connecting to the store at {host}:{port}")
        left = end - time.monotonic()
        if left <= 0:
            raise StoreUnavailable(f"no store at {host}:{port} within {timeout.total_seconds():g} s: {why}")
        failure = probe(host, port, min(PROBE_S, left))
        if failure is None:
            try:
                return dist.TCPStore(
                    host, port, is_master=False, wait_for_workers=False, timeout=min(timeout, _td(left))
                )
            except RuntimeError as e:  # it went away between the probe and the handshake
                failure = str(e).splitlines()[0]
        why = failure
        delay = min(backoff.next(), max(0.0, end - time.monotonic()))
        if stop is not None:
            stop.wait(delay)
        else:
            time.sleep(delay)


def try_connect(addr: tuple[str, int], timeout: timedelta) -> dist.TCPStore | None:
    """A client of the store at `addr` if it accepts a connection now (one probe), else None."""
    import torch.distributed as dist

    if probe(*addr) is not None:
        return None
    try:
        return dist.TCPStore(addr[0], addr[1], is_master=False, wait_for_workers=False, timeout=timeout)
    except RuntimeError:
        return None


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=max(seconds, 0.001))


def check_reachable(addr: tuple[str, int], timeout: timedelta) -> str | None:
    """None if a rendezvous store answers at `addr` (a set and a get round trip) within `timeout`,
    else why not (one line)."""
    host, port = addr
    failure = probe(host, port, timeout.total_seconds())
    if failure is not None:
        return failure
    try:
        client = connect(addr, timeout)
        client.set("recycle/probe", "1")
        client.get("recycle/probe")
    except RuntimeError as e:
        return f"it does not answer as a TCPStore ({str(e).splitlines()[0]})"
    return None


class StoreClient:
    """A store client that reconnects: after the store died and an empty one was restarted on the same
    address, the next call goes to the new one. With `server` (the launcher hosts the store itself) it
    is that object, which cannot lose its store."""

    def __init__(
        self, addr: tuple[str, int], timeout: timedelta, server: dist.TCPStore | None = None
    ) -> None:
        self.addr, self.timeout = addr, timeout
        self._server = server
        self._client: dist.TCPStore | None = server

    def connect(self) -> None:
        """Connect now (waiting for the store within `timeout`; StoreUnavailable past it)."""
        if self._client is None:
            self._client = connect(self.addr, self.timeout)

    def set(self, key: str, value: str) -> None:
        """Set `key` on the store that is up now (reconnecting, within `timeout`; StoreUnavailable
        past it). A key set on a store that dies is lost with it."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            if self._client is None:
                self._client = connect(self.addr, self.timeout, deadline)
            try:
                # A set gets no answer: on a connection to a store that died it may "succeed" and be
                # lost. The check's answer proves the key is on the store that is up now.
                self._client.set(key, value)
                if not self._client.check([key]):
                    raise RuntimeError(f"key {key} not on the store after setting it")
                return
            except RuntimeError as e:
                if self._server is not None or time.monotonic() > deadline:
                    raise
                logger.warning("store %s:%d: %s; reconnecting", *self.addr, str(e).splitlines()[0])
                self._client = None
