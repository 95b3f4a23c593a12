"""Background solves as Ray tasks when RECYCLE_RAY_ADDRESS is set (the Solver's background queue).

The Solver's background work (CP-SAT refinement after a cache miss, then precompute) runs as Ray
tasks of api.solver.solve on that cluster; event-path and POST /v1/plan solves stay in local
processes (latency). The Ray driver is a process of its own, spawned at start-up: Ray's core worker
ends the process it lives in when the cluster's head stays unreachable for a minute, and that must
not be the service. The service sends it requests over a pipe; a thread of the service hands the
answers back to the event loop.

The driver reuses `recycle precompute --ray`'s pieces (whatif/precompute_ray.py): connect, the
errors of a lost task, RETRIES. The job spec goes into the object store once per job (the last
JOB_REFS jobs keep theirs). A task lost with its worker or node, or not finished within its
budget (attempt_budget_s: twice its time limit per plan it makes, plus ATTEMPT_SLACK_S; a late one
is cancelled on the cluster, so that it frees its CPU), is submitted again, at most RETRIES times (a
warning each), then the request fails with TaskLost: the key is given up and logged, and a later
start plans it. A thread of the driver probes the head's port every PROBE_S (apart from the Ray
calls, which can block for a minute on a dead head); when it refuses PROBE_MISSES times in a row,
the driver reports and ends, and every pending and later request is answered None: the
Solver runs it in its local background pool, with one warning, until the service restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import socket
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from api.errors import SolverBusyError
from api.solve_partition import REPARTITION_PLANS
from api.solver import SolveOutput, solve
from planner.errors import InvalidInputError
from planner.processes import exit_with_parent
from planner.settings import planner_settings
from whatif.precompute_ray import CONNECT_TIMEOUT_S, RETRIES, connect, lost_errors, probe

log = logging.getLogger(__name__)

FLAG = "RECYCLE_RAY_ADDRESS"
START_TIMEOUT_S = 60.0  # connecting (ray.init) may take this long before start-up gives up
PROBE_S = 1.0  # how often the driver checks that the head still accepts connections
PROBE_MISSES = 3  # consecutive refused probes that make the cluster lost
ATTEMPT_SLACK_S = 60.0  # a task not finished within attempt_budget_s after submission counts as lost
JOB_REFS = 32  # job specs kept in the object store (least recently used dropped)


class TaskLost(SolverBusyError):
    """A background solve lost with its Ray worker or node RETRIES + 1 times (or that raised on Ray)."""


def check_ray() -> str | None:
    """For `recycle serve`: None when RECYCLE_RAY_ADDRESS is unset or empty, or Ray is installed, its
    head accepts a TCP connection and a driver connects to it (then disconnects: the service connects
    its own), else the one-line reason (exit 2). A port that listens but is no Ray head's (the
    dashboard's, say) fails the connection, not the service's start-up later."""
    try:
        address = planner_settings().ray_address
        if address:
            probe(address, FLAG)
            trial = RayBackground(address)
            trial.connect()
            trial.close()
    except InvalidInputError as exc:
        return str(exc)
    return None


def attempt_budget_s(args: tuple[Any, ...]) -> float:
    """How long a solve(*args) task may take after submission before it counts as lost: twice its
    time limit (args[2]) per plan it makes, plus ATTEMPT_SLACK_S. A re-partition choice (args[4]
    true, no partition given in args[5]) plans up to REPARTITION_PLANS candidates, each within the
    limit (api/solve_partition.py)."""
    choose = len(args) > 4 and bool(args[4]) and (len(args) < 6 or args[5] is None)
    plans = REPARTITION_PLANS if choose else 1
    return 2 * float(args[2]) * plans + ATTEMPT_SLACK_S


class _Driver:
    """The driver process's loop: requests from the pipe become Ray tasks, answers go back."""

    def __init__(self, ray: Any, conn: Connection, endpoint: tuple[str, int] | None) -> None:
        self.ray, self.conn, self.endpoint = ray, conn, endpoint
        self.task = ray.remote(num_cpus=1, max_retries=0)(solve)
        self.lost = lost_errors()
        self.jobs: OrderedDict[str, Any] = OrderedDict()  # job JSON -> its object ref
        # in flight: ref -> (request id, args, resubmissions so far, deadline)
        self.pending: dict[Any, tuple[int, tuple[Any, ...], int, float]] = {}
        self.inbox: queue.Queue[tuple[int, tuple[Any, ...]] | None] = queue.Queue()
        self.send_lock = threading.Lock()  # the loop and the probe thread both answer on the pipe

    def send(self, msg: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = None
            self.inbox.put(msg)
            if msg is None:
                return

    def _submit(self, req: int, args: tuple[Any, ...], attempt: int) -> None:
        """solve(*args) as a task, the job JSON (args[0]) by its object ref."""
        job_json = args[0]
        ref = self.jobs.get(job_json)
        if ref is None:
            ref = self.jobs[job_json] = self.ray.put(job_json)
            while len(self.jobs) > JOB_REFS:
                self.jobs.popitem(last=False)
        self.jobs.move_to_end(job_json)
        deadline = time.monotonic() + attempt_budget_s(args)
        self.pending[self.task.remote(ref, *args[1:])] = (req, args, attempt, deadline)

    def _lost(self, req: int, args: tuple[Any, ...], attempt: int, why: str) -> None:
        if attempt >= RETRIES:
            self.send(("fail", req, f"a solve was lost on Ray {attempt + 1} times (last: {why})"))
            return
        again = f"submitting it again (retry {attempt + 1} of {RETRIES})"
        self.send(("warn", f"a background solve was lost on Ray ({why}); {again}"))
        self._submit(req, args, attempt + 1)

    def _finish(self, ref: Any) -> None:
        req, args, attempt, _ = self.pending.pop(ref)
        try:
            out = self.ray.get(ref)
        except self.lost as exc:
            self._lost(req, args, attempt, type(exc).__name__)
            return
        except Exception as exc:  # the task raised (api.solver.solve catches planner errors itself)
            first = (str(exc).strip().splitlines() or [""])[0]
            self.send(("fail", req, f"a solve failed on Ray: {type(exc).__name__}: {first}"))
            return
        self.send(("done", req, out))

    def _head_reachable(self) -> bool:
        if self.endpoint is None:
            return True
        try:
            socket.create_connection(self.endpoint, timeout=CONNECT_TIMEOUT_S).close()
        except OSError:
            return False
        return True

    def _probe(self) -> None:
        """Its own thread: a Ray call on a dead head (ray.wait, ray.get) can block up to Ray's GCS
        reconnect timeout (60 s), which must not delay noticing that the head is gone."""
        misses = 0
        while True:
            time.sleep(PROBE_S)
            misses = 0 if self._head_reachable() else misses + 1
            if misses >= PROBE_MISSES:
                where = f"{self.endpoint[0]}:{self.endpoint[1]}" if self.endpoint else "?"
                self.send(("lost", f"the Ray head at {where} refuses connections"))
                os._exit(0)  # no ray.shutdown(): it may wait on the dead head

    def run(self) -> None:
        threading.Thread(target=self._read, name="requests", daemon=True).start()
        if self.endpoint is not None:
            threading.Thread(target=self._probe, name="head-probe", daemon=True).start()
        while True:
            try:
                while True:
                    msg = self.inbox.get(timeout=PROBE_S) if not self.pending else self.inbox.get_nowait()
                    if msg is None:
                        return
                    self._submit(*msg, 0)
            except queue.Empty:
                pass
            if self.pending:
                ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=0.05)
                for ref in ready:
                    self._finish(ref)
            now = time.monotonic()
            for ref, (req, args, attempt, deadline) in list(self.pending.items()):
                if now > deadline:
                    del self.pending[ref]
                    with contextlib.suppress(Exception):  # else it holds a CPU until it ends
                        self.ray.cancel(ref, force=True)
                    self._lost(req, args, attempt, "no answer in time")


def _driver_main(address: str, conn: Connection, parent_pid: int) -> None:
    """The driver process: connect, report ("ready", CPUs) or ("error", line), then serve requests."""
    exit_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING)
    try:
        connect(address, FLAG, trial=False)  # this process is the trial (started with a deadline)
        endpoint = probe(address, FLAG)
    except InvalidInputError as exc:
        conn.send(("error", str(exc)))
        return
    import ray

    conn.send(("ready", max(1, int(ray.cluster_resources().get("CPU", 1)))))
    driver = _Driver(ray, conn, endpoint)
    try:
        driver.run()
    except Exception as exc:  # e.g. the cluster went away under ray.put: the service goes local
        driver.send(("lost", f"the Ray driver failed ({type(exc).__name__}: {exc})".splitlines()[0]))
        os._exit(1)
    ray.shutdown()


class RayBackground:
    """The service's handle on the driver process (all methods run on the event loop's thread)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.cpus = 0  # the cluster's CPUs when it connected: how many solves to keep in flight
        self.alive = False
        self.tasks = 0  # solves sent to Ray
        self._futures: dict[int, asyncio.Future[SolveOutput | None]] = {}
        self._ids = itertools.count()
        self._closing = False

    def start(self) -> None:
        """Spawn the driver and wait until it connected (connect), then take its answers on the event
        loop; InvalidInputError (one line) when it cannot connect."""
        self.connect()
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="ray-answers", daemon=True).start()
        log.info("background solves run on the Ray cluster at %s (%d CPUs)", self.address, self.cpus)

    def connect(self) -> None:
        """Spawn the driver and wait until it connected; InvalidInputError (one line) when it cannot
        (the driver is ended then)."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # Ctrl+C is the service's
        try:
            self._proc = ctx.Process(
                target=_driver_main, args=(self.address, child, os.getpid()), name="recycle-ray-driver"
            )
            self._proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        child.close()
        try:
            if self._conn.poll(START_TIMEOUT_S):
                kind, value = self._conn.recv()
            else:  # the driver is closed below, not left connecting
                kind, value = "error", f"{FLAG} {self.address}: no connection after {START_TIMEOUT_S:.0f} s"
        except (EOFError, OSError):
            kind, value = "error", f"{FLAG} {self.address}: the Ray driver process ended while connecting"
        if kind != "ready":
            self._proc.kill()  # still connecting (a timeout: ray.init defers SIGTERM), or ending anyway
            self.close()
            raise InvalidInputError(str(value))
        self.cpus, self.alive = int(value), True

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                msg = ("lost", "the Ray driver process ended")
            try:
                self._loop.call_soon_threadsafe(self._answer, msg)
            except RuntimeError:  # the loop is closed: the service stopped
                return
            if msg[0] == "lost":
                return

    def _answer(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "warn":
            log.warning("%s", msg[1])
        elif kind == "lost":
            self.alive = False
            if not self._closing:
                log.warning("%s: background solves fall back to the local pool until a restart", msg[1])
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_result(None)
            self._futures.clear()
        else:
            answered = self._futures.pop(msg[1], None)
            if answered is None or answered.done():
                return
            if kind == "done":
                answered.set_result(msg[2])
            else:
                answered.set_exception(TaskLost(msg[2]))

    async def solve(self, *args: Any) -> SolveOutput | None:
        """solve(*args) as a Ray task; None when Ray is lost (run it locally); TaskLost when it was
        lost RETRIES + 1 times."""
        if not self.alive:
            return None
        req = next(self._ids)
        fut: asyncio.Future[SolveOutput | None] = self._loop.create_future()
        self._futures[req] = fut
        try:
            self._conn.send((req, args))
        except OSError:
            self._futures.pop(req, None)
            return None  # the driver ended; its reader thread reports it
        self.tasks += 1
        try:
            return await fut
        finally:
            self._futures.pop(req, None)  # cancelled: the answer is dropped when it comes

    def close(self) -> None:
        """Ask the driver to disconnect (ray.shutdown) and end; terminate it after 10 s."""
        self._closing, self.alive = True, False
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        with contextlib.suppress(OSError):
            self._conn.send(None)
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        self._conn.close()
