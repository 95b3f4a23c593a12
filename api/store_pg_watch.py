"""A watchdog for PostgreSQL calls that hang: the store's calls are synchronous, many of them on the
event loop, and a server that stops answering without closing its sockets (a hung or SIGSTOPped
server, a network partition behind a proxy) would block the loop, and with it every long-poll answered
from memory, for as long as the server hangs: libpq has no client-side timeout once connected.

Every call registers its connection with a deadline (`watch`). A thread checks the deadlines every
TICK_S; a call past its deadline has its socket shut down (`shutdown(2)` on a duplicate of the file
descriptor), so the blocked call fails at once with OperationalError (503) and the pool drops the
connection. The listener's liveness probe (`SELECT 1`, api/store_pg_coord.py) is watched with a
short deadline (PROBE_STALL_S): when it hangs the server is taken for gone, the store is marked down
(new calls answer 503 at once) and every watched call is cut, whatever its own deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

TICK_S = 0.1
PROBE_STALL_S = 1.0  # `SELECT 1` on a live server takes milliseconds


class Watchdog:
    """Cuts the connections of calls past their deadline (see the module docstring)."""

    def __init__(self, on_server_hung: Callable[[], None]) -> None:
        self._busy: dict[int, tuple[Any, float, bool]] = {}  # id -> (connection, deadline, is probe)
        self._lock = threading.Lock()
        self._next = 0
        self._stop = threading.Event()
        self._on_server_hung = on_server_hung
        self._thread = threading.Thread(target=self._run, name="recycle-pg-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watch(self, conn: Any, limit_s: float, probe: bool = False) -> Iterator[None]:
        """Run the body with `conn` cut if it is still busy after `limit_s`."""
        with self._lock:
            self._next += 1
            key = self._next
            self._busy[key] = (conn, time.monotonic() + limit_s, probe)
        try:
            yield
        finally:
            with self._lock:
                self._busy.pop(key, None)

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            with self._lock:
                late = [(k, c, p) for k, (c, deadline, p) in self._busy.items() if now > deadline]
                if any(p for _, _, p in late):  # the server hangs: cut every call waiting on it
                    late = [(k, c, p) for k, (c, _, p) in self._busy.items()]
                for k, _, _ in late:
                    self._busy.pop(k, None)
            if any(p for _, _, p in late):
                log.warning("database probe hung for %.1f s: cutting %d calls", PROBE_STALL_S, len(late))
                self._on_server_hung()
            for _, conn, _ in late:
                _cut(conn)


def _cut(conn: Any) -> None:
    """Shut down `conn`'s socket: a call blocked on it returns at once with an error."""
    with contextlib.suppress(Exception):
        fd = os.dup(conn.fileno())
        with socket.socket(fileno=fd) as sock:
            sock.shutdown(socket.SHUT_RDWR)
