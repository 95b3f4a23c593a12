"""Several "hosts" on one machine: Linux network namespaces joined by a bridge.

Used by tests/test_multihost.py and `python -m bench.multihost`. Needs iproute2's `ip` and
CAP_NET_ADMIN (root); `skip_unless_netns()` skips a test with a one-line reason where `ip netns add`
is not permitted.

Layout for `Netns(["ctl", "h0", "h1", "h2"])`, P this process's pid:

    rcyP-br    bridge br0, ports v0 v1 v2 v3 (the bridge has a namespace of its own)
    rcyP-ctl   lo, eth0 10.231.0.1/24  <- veth -> v0
    rcyP-h0    lo, eth0 10.231.0.2/24  <- veth -> v1
    rcyP-h1    lo, eth0 10.231.0.3/24  <- veth -> v2
    rcyP-h2    lo, eth0 10.231.0.4/24  <- veth -> v3

Every interface and address lives in these namespaces, none in the root one: the veth pairs are
created inside the bridge's namespace with their other end placed straight into the host's, and the
bridge has no uplink and the hosts no default route, so no packet leaves them. The pid in the names
keeps concurrent runs apart (addresses may repeat: each run has its own bridge). Namespaces left by a
run that was SIGKILLed (its pid is gone) are removed by the next `Netns`, with the processes still
running in them (`remove_stale`).

- `popen(name, cmd, log=...)`: `ip netns exec <ns> cmd` in a session of its own (the Popen's pid is
  the command's: `ip netns exec` execs it), stdout and stderr to `log`; `kill(name)` SIGKILLs every
  process started in that namespace (a host crash);
- `link_down(name)` / `link_up(name)`: the host's link, switched at its bridge end (the switch port):
  the host keeps its address, routes and sockets, no process is told anything, packets to and from it
  just vanish (a silent partition); `link_up` heals it;
- `call(name, fn, *args)`: run `fn` in a thread that lives in that namespace (setns(2) moves one
  thread), e.g. HTTP requests from the test process to a service in "ctl";
- `close()` (also `__exit__`, at interpreter exit, on Ctrl-C): kills the process group of every
  process started here, stops the namespace threads, deletes every namespace.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")

PREFIX = "rcy"
SUBNET = "10.231.0"  # host k (0-based, in the order given) gets SUBNET.(k+1)/24
IFNAME = "eth0"  # the interface name inside every host namespace (GLOO_SOCKET_IFNAME for gloo)
CLONE_NEWNET = 0x40000000
NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `ip args...` (10 s limit); raise RuntimeError with its stderr when it fails and `check`."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r


def namespaces() -> list[str]:
    """The names `ip netns list` shows."""
    r = ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def leftovers(pid: int | None = None) -> list[str]:
    """Namespaces of this harness (of run `pid`, or of any run) that still exist."""
    head = f"{PREFIX}{pid}-" if pid is not None else PREFIX
    return [n for n in namespaces() if n.startswith(head) and re.match(rf"^{PREFIX}\d+-", n)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (a run killed with SIGKILL), after killing
    the processes that run still had in them (`ip netns pids`); their names."""
    gone = []
    for name in leftovers():
        pid = int(name[len(PREFIX) :].split("-", 1)[0])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        for orphan in ip("netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(orphan), signal.SIGKILL)
        if ip("netns", "delete", name, check=False).returncode == 0:
            gone.append(name)
    return gone


@functools.lru_cache(maxsize=1)
def netns_unavailable() -> str | None:
    """Why namespaces, veth pairs and a bridge cannot be made here (None: they can). Probed once."""
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (not on PATH)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        r = ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[0]
            return f"`ip netns add` is not permitted here (needs CAP_NET_ADMIN): {why}"
        for args in (("link", "add", "pbr", "type", "bridge"), ("link", "add", "pa", "type", "veth", "peer",
                                                                "name", "pb")):  # fmt: skip
            r = ip("-n", probe, *args, check=False)
            if r.returncode != 0:
                return f"`ip link add ... type {args[4]}` failed: {r.stderr.strip() or r.returncode}"
        return None
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns` unusable: {e}"
    finally:
        ip("netns", "delete", probe, check=False)


def skip_unless_netns() -> None:
    """pytest.skip with a one-line reason where network namespaces cannot be made."""
    reason = netns_unavailable()
    if reason is not None:
        import pytest

        pytest.skip(reason)


def _setns(path: str) -> None:
    """Move the calling thread into the network namespace bound at `path`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Netns:
    """Namespaces `rcy<pid>-<name>` for `names` on one bridge; see the module doc. A context manager."""

    def __init__(self, names: Sequence[str], subnet: str = SUBNET) -> None:
        if len(set(names)) != len(names) or not all(NAME_RE.match(n) for n in names) or "br" in names:
            raise ValueError(f"names must be distinct, [a-z][a-z0-9]{{0,7}} and not 'br': {list(names)}")
        if not 0 < len(names) < 250:
            raise ValueError("between 1 and 249 namespaces")
        self.names = list(names)
        self.subnet = subnet
        self.pid = os.getpid()
        self.bridge = f"{PREFIX}{self.pid}-br"
        self.procs: dict[str, list[subprocess.Popen[bytes]]] = {n: [] for n in self.names}
        self._threads: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._created: list[str] = []
        self._closed = False

    # names and addresses

    def ns(self, name: str) -> str:
        """The namespace name of host `name`."""
        self._check(name)
        return f"{PREFIX}{self.pid}-{name}"

    def addr(self, name: str) -> str:
        """Host `name`'s address."""
        self._check(name)
        return f"{self.subnet}.{self.names.index(name) + 1}"

    def port(self, name: str) -> str:
        """The bridge port (in the bridge's namespace) of host `name`'s link."""
        self._check(name)
        return f"v{self.names.index(name)}"

    def _check(self, name: str) -> None:
        if name not in self.names:
            raise KeyError(f"no host {name!r} (hosts: {', '.join(self.names)})")

    # set-up and tear-down

    def __enter__(self) -> Netns:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Netns:
        """Create the bridge namespace, the host namespaces and their links."""
        remove_stale()
        atexit.register(self.close)
        self._add(self.bridge)
        ip("-n", self.bridge, "link", "set", "lo", "up")
        ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge, "link", "set", "br0", "up")
        for name in self.names:
            ns, port = self.ns(name), self.port(name)
            self._add(ns)
            ip("-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            ip("-n", self.bridge, "link", "set", port, "master", "br0")
            ip("-n", self.bridge, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"{self.addr(name)}/24", "dev", IFNAME)
            ip("-n", ns, "link", "set", IFNAME, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        return self

    def _add(self, ns: str) -> None:
        ip("netns", "add", ns)
        self._created.append(ns)

    def close(self) -> None:
        """Kill every process started here (its process group), stop the namespace threads, delete the
        namespaces. Idempotent; Ctrl-C during it is held until it is done."""
        if self._closed:
            return
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:  # every step best effort: one that fails (an `ip` timeout) must not skip the others
            for procs in self.procs.values():
                for p in procs:
                    if p.poll() is None:  # a reaped leader's pid may belong to someone else by now
                        _best_effort(_kill_group, p)
            for pool in self._threads.values():
                _best_effort(pool.shutdown, wait=True, cancel_futures=True)
            for ns in reversed(self._created):  # the hosts first (their veths go with them), the bridge last
                _best_effort(_kill_inside, ns)  # what is left inside (`ip netns delete` only unmounts)
                _best_effort(ip, "netns", "delete", ns, check=False)
            self._closed = True
            atexit.unregister(self.close)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    # processes

    def popen(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `cmd` in host `name`'s namespace, in a session of its own; stdout and stderr appended to
        `log` (else discarded). The Popen's pid is the command's own."""
        if self._closed:
            raise RuntimeError("the namespaces are gone")
        out: IO[bytes] | int = subprocess.DEVNULL
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = log.open("ab")
        try:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.ns(name), *cmd],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()
        self.procs[name].append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes]) -> int | None:
        """SIGKILL the process group of `p` (one started here) if `p` still runs; its exit code."""
        if p.poll() is None:
            _kill_group(p)
        return p.returncode

    def kill(self, name: str) -> list[subprocess.Popen[bytes]]:
        """SIGKILL every process in host `name` (a host crash): the ones started here and every other
        process in its namespace (their children: an agent's workers). The started ones that were
        running."""
        hit = [p for p in self.procs[name] if p.poll() is None]
        for p in hit:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        _kill_inside(self.ns(name))
        return hit

    # the link

    def link_down(self, name: str) -> None:
        """Cut host `name` off silently: its switch port goes down (no process is told anything)."""
        ip("-n", self.bridge, "link", "set", self.port(name), "down")

    def link_up(self, name: str) -> None:
        """Heal host `name`'s link."""
        ip("-n", self.bridge, "link", "set", self.port(name), "up")

    # running code of this process inside a namespace

    def call(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a thread living in host `name`'s namespace (one thread per host,
        calls run one at a time); sockets it opens belong to that namespace. Close them before
        `close()`: an open socket keeps its namespace alive after `ip netns delete`."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the namespaces are gone")
            pool = self._threads.get(name)
            if pool is None:
                path = f"/run/netns/{self.ns(name)}"
                pool = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{name}", initializer=_setns,
                                          initargs=(path,))  # fmt: skip
                self._threads[name] = pool
        return pool.submit(fn, *args, **kwargs).result()


def _best_effort(fn: Any, *args: Any, **kwargs: Any) -> None:
    """Run one clean-up step; report (never raise) what went wrong."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        print(f"netns clean-up: {getattr(fn, '__name__', fn)}{args}: {e}", file=sys.stderr)


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still in namespace `ns` (`ip netns pids`)."""
    for pid in ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group of `p` (its session: started with start_new_session) and reap `p`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)


def tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of a text file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_for(pred: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> float:
    """Poll `pred` until true; the time.monotonic() it became true. TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)
