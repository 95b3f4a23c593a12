"""Raw-socket long-poll clients for bench.service: a few processes, each a `selectors` (epoll) loop
over its share of the pollers, no HTTP library.

Each process keeps its pollers' keep-alive sockets across rounds (as workers do) and, per round,
sends every poller's `GET .../schedule?worker=d,s&after_version=V&wait=W`, tells the parent once all
requests are out, then collects the answers: per poller the monotonic time its complete answer
arrived (time.perf_counter is CLOCK_MONOTONIC, system-wide on Linux, so the parent can subtract its
own timestamps), or the kind of error (refused, reset, closed, http_<status>, stale, timeout).
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import re
import resource
import selectors
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

_VERSION = re.compile(rb'"version":\s*(\d+)')


def raise_nofile() -> tuple[int, int]:
    """Raise this process's RLIMIT_NOFILE soft limit to the hard one; (soft, hard) afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


@dataclass
class Poller:
    addr: tuple[str, int]
    coords: dict[str, int]
    request: bytes = b""
    sock: socket.socket | None = None
    buf: bytes = b""
    fresh: bool = True  # the socket was opened for this request (else: a reused keep-alive one)
    done_at: float | None = None
    error: str | None = None


@dataclass
class Round:
    pollers: list[Poller]
    sel: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    pending: int = 0
    writing: int = 0  # sockets waiting to connect and send (registered for EVENT_WRITE)

    def finish(self, p: Poller, error: str | None, keep: bool = True) -> None:
        assert p.sock is not None
        self.sel.unregister(p.sock)
        p.error, self.pending = error, self.pending - 1
        if error is None:
            p.done_at = time.perf_counter()
        if error is not None or not keep:
            p.sock.close()
            p.sock = None

    def connect(self, p: Poller) -> None:
        p.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        p.sock.setblocking(False)
        p.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        p.fresh = True
        code = p.sock.connect_ex(p.addr)
        if code not in (0, errno.EINPROGRESS):
            p.sock.close()
            p.sock, p.error, self.pending = None, "refused", self.pending - 1
            return
        self.sel.register(p.sock, selectors.EVENT_WRITE, p)
        self.writing += 1

    def send(self, p: Poller) -> None:
        assert p.sock is not None
        p.buf = b""
        self.writing -= 1
        try:
            p.sock.send(p.request)  # a few hundred bytes: one send on a fresh socket buffer
        except OSError:
            self.sel.unregister(p.sock)
            p.sock.close()
            if p.fresh:
                p.sock, p.error, self.pending = None, "reset", self.pending - 1
                return
            self.connect(p)  # the server closed an idle keep-alive socket: reconnect, as a worker would
            return
        self.sel.modify(p.sock, selectors.EVENT_READ, p)

    def on_event(self, p: Poller, mask: int, after: int) -> None:
        assert p.sock is not None
        if mask & selectors.EVENT_WRITE:
            err = p.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.writing -= 1
                self.finish(p, "refused")
            else:
                self.send(p)
            return
        try:
            chunk = p.sock.recv(65536)
        except OSError:
            chunk = None
        if not chunk:
            if not p.fresh and not p.buf:  # idle keep-alive socket closed by the server: reconnect
                self.sel.unregister(p.sock)
                p.sock.close()
                self.connect(p)
                return
            self.finish(p, "reset" if chunk is None else "closed")
            return
        p.buf += chunk
        head, sep, body = p.buf.partition(b"\r\n\r\n")
        if not sep:
            return
        status = head[9:12]
        if status == b"304":
            self.finish(p, "timeout_304")
            return
        length = next(
            (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
        )
        if len(body) < length:
            return
        if status != b"200":
            self.finish(p, f"http_{status.decode()}")
            return
        m = _VERSION.search(body)
        self.finish(p, None if m is not None and int(m.group(1)) > after else "stale")


def run_round(
    pollers: list[Poller], target: str, token: str, after: int, deadline_s: float, conn: Connection
) -> None:
    """One round for this process's pollers; sends ("sent", n) when every request is out, then
    ("done", [(replica port, answer time)], {error kind: count})."""
    rnd = Round(pollers, pending=len(pollers))
    for p in pollers:
        p.request = (
            f"GET {target.format(**p.coords)} HTTP/1.1\r\nHost: {p.addr[0]}\r\n"
            f"Authorization: Bearer {token}\r\n\r\n"
        ).encode()
        p.done_at, p.error = None, None
        if p.sock is None:
            rnd.connect(p)
        else:
            p.fresh = False
            rnd.sel.register(p.sock, selectors.EVENT_WRITE, p)
            rnd.writing += 1
    deadline = time.monotonic() + deadline_s
    announced = False
    while rnd.pending and time.monotonic() < deadline:
        for key, mask in rnd.sel.select(timeout=0.05):
            rnd.on_event(key.data, mask, after)
        if not announced and rnd.writing == 0:
            conn.send(("sent", len(pollers)))
            announced = True
    if not announced:
        conn.send(("sent", len(pollers)))
    for p in pollers:
        if p.done_at is None and p.error is None:
            p.error = "timeout"
            if p.sock is not None:
                rnd.sel.unregister(p.sock)
                p.sock.close()
                p.sock = None
    rnd.sel.close()
    errors = Counter(p.error for p in pollers if p.error is not None)
    answered = [(p.addr[1], p.done_at) for p in pollers if p.done_at is not None]
    conn.send(("done", answered, dict(errors)))


def client_main(
    conn: Connection, addrs: list[tuple[str, int]], indices: list[int], dims: tuple[int, int]
) -> None:
    """A client process: pollers i in `indices` on replica addrs[i % len(addrs)], worker i mod grid;
    runs a round per ("round", target, token, after, deadline_s) message until ("stop",)."""
    raise_nofile()
    d_max, p_max = dims
    pollers = [Poller(addrs[i % len(addrs)], {"d": i % d_max, "s": (i // d_max) % p_max}) for i in indices]
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, target, token, after, deadline_s = msg
        run_round(pollers, target, token, after, deadline_s, conn)
    for p in pollers:
        if p.sock is not None:
            p.sock.close()


class ClientPool:
    """`procs` client processes (spawned) sharing `pollers` pollers spread over `addrs`."""

    def __init__(self, addrs: list[tuple[str, int]], pollers: int, procs: int, dims: tuple[int, int]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for k in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_main, args=(child, addrs, list(range(k, pollers, procs)), dims))
            proc.daemon = True
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def start_round(self, target: str, token: str, after: int, deadline_s: float) -> None:
        """`target` is the path and query with {d} and {s} for the worker's coordinates."""
        for c in self.conns:
            c.send(("round", target, token, after, deadline_s))

    def wait_sent(self, timeout: float) -> bool:
        """True once every process has sent all its requests (False after `timeout` seconds)."""
        end = time.monotonic() + timeout
        for c in self.conns:
            if not c.poll(max(0.0, end - time.monotonic())):
                return False
            assert c.recv()[0] == "sent"
        return True

    def results(self, timeout: float) -> tuple[list[tuple[int, float]], Counter[str]]:
        """[(replica port, answer time)] of the pollers answered, and the others' error kinds."""
        times: list[tuple[int, float]] = []
        errors: Counter[str] = Counter()
        end = time.monotonic() + timeout
        for c in self.conns:
            while c.poll(max(0.0, end - time.monotonic())):
                msg = c.recv()
                if msg[0] == "done":
                    times += msg[1]
                    errors.update(msg[2])
                    break
            else:
                errors["client_process_lost"] += 1
        return times, errors

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(("stop",))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
