"""Worker processes forked from a process that has already imported torch (a fork server).

A worker started as `python -m runtime_adapter.cli worker ...` spends 2-4 s of CPU importing torch
before it does anything; a launch of six workers on two cores waits ~10 s for that, and a re-joiner
keeps its peers waiting in the rendezvous as long. A supervisor (launcher or agent) on a CPU job
instead starts one fork server, which imports the worker's modules once and forks a worker per
request (~50 ms). A forked worker is the same program: it runs `runtime_adapter.cli.main` on its own
argv, environment, working directory and log file, and exits with its code.

- Only for `--device cpu`: CUDA must not be initialized before a fork, and the server never touches
  it, but a GPU job keeps the plain process start (`RECYCLE_FORK_WORKERS=0` turns it off on CPU too).
- One server per supervising process (`shared`), started at its first worker: launches run one
  after the other in one process (tests, a notebook) pay its imports once. Each request carries the
  worker's whole environment; the child takes its `PYTHONPATH` into `sys.path` and drops the
  server's import caches, so a module written since the server started is found.
- Its command line is `python -m runtime_adapter.forkserver worker`, which a forked worker shows as
  its own; `cli_inputs.runs_in` tells a launch's live workers by `worker` there and by their output
  (descriptor 1) being a log in the launch's directory.
- The server reaps its children and reports each exit code; the supervisor's handle (`ForkedWorker`)
  offers the part of `subprocess.Popen` it uses (`pid`, `poll`, `wait`, `kill`, `returncode`).
- The server ends when the process that started it does (its request pipe closes); workers started with
  `--exit-with-parent` then end too, as they would with their supervisor gone.
- If the server cannot start, is not ready within READY_TIMEOUT_S (a hung import) or cannot fork
  (a process limit), the supervisor starts workers as plain processes. One that dies takes its
  workers with it (`--exit-with-parent`); the supervisor handles them as failures (their codes are
  lost: -9) and starts a new server for the workers it restarts.
- Replies go on a descriptor of their own (the server's stdout is its stderr), so a stray print of a
  preloaded module cannot corrupt them. Each child draws new `random` and numpy seeds.
- Each worker is named its parent (`--exit-with-parent=<server pid>`), so one whose server died
  before it looked ends at once (exit 2, one line), and the supervisor signals it through a pidfd,
  never a later process given the same pid.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from runtime_adapter.stop_signals import shielded

logger = logging.getLogger(__name__)

MODULE = "runtime_adapter.forkserver"
# what `recycle worker` imports (lazily, in runtime_adapter/cli.py), imported by the server before any fork
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",  # the meta-device checks before start import it (normal_ on meta): 2 s
    "runtime_adapter.cli",
    "runtime_adapter.client",
    "runtime_adapter.heartbeats",
    "runtime_adapter.worker",
    "runtime_adapter.model",
    "planner.processes",
)
READY = "ready"
READY_TIMEOUT_S = 60.0  # the preload takes 2-5 s (20 s on a loaded machine); a server past this is stuck
WAIT_POLL_S = 0.02


class ForkServerError(RuntimeError):
    """The fork server could not start a worker (it died, or never started)."""


class ForkedWorker:
    """A worker forked by the fork server: the part of `subprocess.Popen` the supervisor uses."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None
        self.started = start_time(pid)  # tells this process from a later one given the same pid
        self._pidfd: int | None = None  # signals reach this process only, never a later one with its pid
        with contextlib.suppress(OSError, AttributeError):  # gone already; no pidfd (Linux < 5.3)
            self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                with shielded():
                    self.returncode = self.server.exit_code(self.pid, self.started)
            finally:  # also when a stop signal held back by the shield is raised on leaving it
                if self.returncode is not None and self._pidfd is not None:
                    os.close(self._pidfd)
                    self._pidfd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(WAIT_POLL_S)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile: the server reports its code
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signum)
                else:
                    os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """The supervisor's side: starts the server process, sends it fork requests, collects exit codes
    (a reader thread). `spawn` raises ForkServerError when the server is gone."""

    def __init__(self, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", MODULE, "worker"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self._lock, self._cond = threading.Lock(), threading.Condition()
        self._codes: dict[int, int] = {}
        self._forked: dict[int, int | str] = {}  # request id -> pid, or why the fork failed
        self._next_id = 0
        self._buffer = b""  # read from the server, not yet a whole line
        self._alive = self._ready()
        threading.Thread(target=self._read, name="recycle-forkserver", daemon=True).start()

    def _ready(self) -> bool:
        """Whether the server said it is ready within READY_TIMEOUT_S (lines before that, printed at
        interpreter start-up, are skipped); one that did not (a hung import, a crash) is ended, and
        the supervisor starts plain processes instead."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (line := self._line(deadline)) is not None:
            if line.strip() == READY.encode():
                return True
            if line.strip():
                logger.warning("fork server said before it was ready: %r", line[:200])
        logger.warning("fork server not ready within %g s: starting plain processes", READY_TIMEOUT_S)
        self.proc.kill()
        return False

    def _line(self, deadline: float | None = None) -> bytes | None:
        """The server's next line (without its newline); None once it ended or `deadline` passed. Read
        from the descriptor itself: a buffered reader could hold a line that select() does not see."""
        fd = self._stdout.fileno()
        while b"\n" not in self._buffer:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return None
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                return None
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _read(self) -> None:
        try:
            while (line := self._line()) is not None:
                try:
                    msg = json.loads(line)
                except ValueError:
                    logger.warning("fork server: unreadable line %r", line[:200])
                    continue
                with self._cond:
                    if "id" in msg:
                        self._forked[int(msg["id"])] = msg["pid"] if "pid" in msg else str(msg["error"])
                        if "pid" in msg:  # a code for this pid before now was an earlier process's
                            self._codes.pop(int(msg["pid"]), None)
                    else:
                        self._codes[int(msg["exit"])] = int(msg["code"])
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._alive = False
                self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self._alive

    def spawn(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedWorker:
        """Fork a worker running `python -m runtime_adapter.cli <argv>`, its output appended to `log`."""
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            request = {"id": rid, "argv": argv, "env": env, "log": str(log), "cwd": os.getcwd()}
            with self._cond:
                if not self._alive:
                    raise ForkServerError("the fork server is not running")
            try:
                self._stdin.write(json.dumps(request).encode() + b"\n")
                self._stdin.flush()
            except OSError as e:
                raise ForkServerError(f"the fork server is gone ({e})") from None
            with self._cond:
                answered = self._cond.wait_for(lambda: rid in self._forked or not self._alive, timeout=30)
                reply = self._forked.pop(rid, None)
            if not answered:  # end it: a fork it makes later must not run beside the plain process
                self.proc.kill()
                raise ForkServerError("the fork server did not answer within 30 s")
            if not isinstance(reply, int):
                raise ForkServerError(f"the fork server could not fork: {reply or 'it died'}")
        return ForkedWorker(self, reply, [sys.executable, "-m", "runtime_adapter.cli", *argv])

    def exit_code(self, pid: int, started: str | None) -> int | None:
        """`pid`'s exit code as the server reported it; None while it runs. Once the server is gone
        its orphans are nobody's to reap here: a process that is gone, a zombie or a later process
        with the same pid counts as ended, with -9 (its code was lost with the server)."""
        with self._cond:
            code = self._codes.get(pid)
            if code is not None or self._alive:
                return code
        now = start_time(pid)
        return None if now is not None and now == started else -int(signal.SIGKILL)

    def close(self) -> None:
        """End the server (its workers are the supervisor's to end first)."""
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_time(pid: int) -> str | None:
    """Process `pid`'s start time (field 22 of /proc/<pid>/stat); None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]


_SHARED: dict[str, ForkServer] = {}
_SHARED_LOCK = threading.Lock()


def shared(env: dict[str, str]) -> ForkServer:
    """This process's fork server, started (with `env`, less what differs per worker) at the first
    call and again after it died; it ends when this process does (its request pipe closes)."""
    with _SHARED_LOCK:
        server = _SHARED.get("server")
        if server is None or not server.alive:
            if server is not None:  # it died (killed from outside): reap it
                server.close()
            server = _SHARED["server"] = ForkServer({k: v for k, v in env.items() if k != "LOCAL_RANK"})
        return server


# --- the server process ---------------------------------------------------------------------------


def _child(request: dict[str, Any], reply_fd: int) -> None:
    """In the forked child: become the worker of `request` and never return."""
    code = 1
    try:
        os.close(reply_fd)  # only the server answers the supervisor
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [sys.executable, *request["argv"]]
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [p for p in paths if p not in sys.path]
        importlib.invalidate_caches()  # a module written since the server listed its directory
        import random

        import torch

        random.seed()  # the server's random state is every child's: draw new ones
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        logging.root.handlers.clear()  # the worker configures its own logging
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
        from runtime_adapter.cli import main

        code = _exit_code(main, request["argv"])
        threading._shutdown()  # type: ignore[attr-defined]  # as at interpreter exit: join non-daemon threads
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # the child must never return into the server's loop
        sys.excepthook(*sys.exc_info())
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _exit_code(main: Any, argv: list[str]) -> int:
    """`main(argv)`'s exit code as `sys.exit(main())` would give it (an uncaught exception: 1)."""
    try:
        return int(main(argv))
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _reply(out: Any, msg: dict[str, Any]) -> None:
    _reply_line(out, json.dumps(msg))


def serve() -> int:
    """The server's loop: one JSON request per line on stdin (fork a worker, reply its pid), exit
    codes of reaped children on stdout; ends when stdin closes (its supervisor is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the supervisor's to handle
    # replies on a descriptor of their own; anything printed (an import's notice too) goes to stderr
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    for module in PRELOAD:  # the imports every worker needs, done once
        importlib.import_module(module)
    requests, out = sys.stdin.buffer, os.fdopen(reply_fd, "wb")
    _reply_line(out, "\n" + READY)  # a newline first ends any partial line printed at start-up
    buffer = b""
    while True:
        readable, _, _ = select.select([requests], [], [], 0.05)
        if readable:
            chunk = os.read(requests.fileno(), 1 << 16)
            if not chunk:  # the supervisor is gone: end now (a normal exit finalizes torch for ~1 s,
                os._exit(0)  # and the workers, --exit-with-parent, end only once this process has)
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as e:  # a process limit, memory: the supervisor starts a plain process
                    _reply(out, {"id": request["id"], "error": str(e)})
                    continue
                if pid == 0:
                    _child(request, reply_fd)
                _reply(out, {"id": request["id"], "pid": pid})
        _reap(out)


def _reply_line(out: Any, text: str) -> None:
    out.write(text.encode() + b"\n")
    out.flush()


def _reap(out: Any) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(out, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    sys.exit(serve())
