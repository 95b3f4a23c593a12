"""`recycle precompute --ray ADDRESS`: the scenarios as tasks on a Ray cluster.

The job spec goes into the object store once (`ray.put`); each task gets its reference and one
canonical scenario and returns the record the local path makes (`whatif.precompute._plan_task`),
which the driver writes to the plan directory as soon as `ray.wait` reports it: the directory and
its resumability are those of the local path. At most `in_flight` tasks are submitted at a time. A
task lost with its worker or its node (worker crash, node death, a result lost with its node's
object store) is submitted again, at most RETRIES times, with a warning on stderr. A task that raises
(a planner error: the same on every try) is not submitted again: the other scenarios go on, and at
the end `ScenariosFailed` names the scenarios that failed (the directory stays resumable: no index
is written). Ray is imported here only, so nothing needs it without `--ray`.

ADDRESS is what `ray.init` accepts: `auto` (the cluster `ray start` left on this machine, or
RAY_ADDRESS), `HOST:PORT` of the head's GCS (from a cluster node) or `ray://HOST:PORT` (Ray Client,
needs `ray[client]`). The address is probed (TCP, CONNECT_TIMEOUT_S) before `ray.init`, which would
otherwise retry for minutes; an unreachable one is an InvalidInputError (exit 2) raised before
anything is written. The workers import this project: install it (same version) into the Python
that runs `ray start` on every node; a worker that cannot is reported in one line.
"""

from __future__ import annotations

import logging
import math
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from planner.contract import FailureScenario
from planner.errors import InvalidInputError

log = logging.getLogger(__name__)

RETRIES = 3  # resubmissions of one scenario lost with its worker or node
WINDOW_REFRESH_S = 10.0  # how often the number of tasks kept in flight follows the cluster's CPUs
CONNECT_TIMEOUT_S = 5.0
CLIENT_INIT_RETRIES = 1  # a Ray Client connection whose server on the head failed to start: once more
FLAG = "--ray/RECYCLE_RAY_ADDRESS"


class ScenariosFailed(RuntimeError):
    """Some scenarios could not be planned on Ray (the others were written): one line, exit 1."""

    def __init__(self, failures: list[tuple[str, BaseException]]) -> None:
        self.failures = failures
        scenario, exc = failures[0]
        first = (str(exc).strip().splitlines() or [""])[0]
        failed = FailureScenario.model_validate_json(scenario).failed
        super().__init__(
            f"{len(failures)} scenario(s) not planned on Ray (the others are written; no index: run again "
            f"to retry them); first: failed {[list(w) for w in failed]}: {type(exc).__name__}: {first}"
        )


def _ray(flag: str = FLAG) -> Any:
    try:
        import ray
    except ImportError:
        raise InvalidInputError(f"{flag}: Ray is not installed (pip install 'recycle[ray]')") from None
    return ray


def _endpoint(address: str, flag: str = FLAG) -> tuple[str, int] | None:
    """The (host, port) that must accept a TCP connection for `address` to work; None: not known."""
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            address = canonicalize_bootstrap_address("auto") or ""
        except ConnectionError:
            raise InvalidInputError(f"{flag} auto: no running Ray cluster found on this machine") from None
        except Exception:  # a private helper: when it changes, let ray.init decide
            return None
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidInputError(f"{flag} {address}: expected auto, HOST:PORT or ray://HOST:PORT")
    return host.strip("[]"), int(port)


def probe(address: str, flag: str = FLAG) -> tuple[str, int] | None:
    """Check that Ray is installed and the head of `address` accepts a TCP connection now (an
    InvalidInputError naming `flag` if not); returns the endpoint probed (None: not known)."""
    _ray(flag)
    endpoint = _endpoint(address, flag)
    if endpoint is not None:
        try:
            socket.create_connection(endpoint, timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            where = f"{endpoint[0]}:{endpoint[1]}"
            raise InvalidInputError(
                f"{flag} {address}: no Ray cluster reachable at {where} ({exc.strerror or exc})"
            ) from None
    return endpoint


TRIAL_TIMEOUT_S = 30.0  # a trial connection that has not succeeded by then: no Ray head there
_TRIAL = (
    "import logging, sys, ray\n"
    "ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)\n"
    "ray.shutdown()\n"
)


def trial_connect(address: str, flag: str = FLAG, timeout_s: float = TRIAL_TIMEOUT_S) -> None:
    """Connect to `address` once in a child process, which is killed after `timeout_s`: a port that
    accepts TCP but is no Ray head's (the dashboard's 8265, an HTTP server) made `ray.init` retry for
    minutes in this process, flooding stderr and ignoring SIGTERM. InvalidInputError if it fails."""
    try:
        run = subprocess.run(
            [sys.executable, "-c", _TRIAL, address], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise InvalidInputError(
            f"{flag} {address}: no Ray head answered within {timeout_s:g} s (the head's GCS port, "
            "6379 by default, is the one to give)"
        ) from None
    if run.returncode != 0:
        lines = [ln for ln in run.stderr.strip().splitlines() if ln.strip()]
        raise InvalidInputError(f"{flag} {address}: cannot connect: {lines[-1] if lines else run.returncode}")


def connect(address: str, flag: str = FLAG, trial: bool = True) -> None:
    """Connect this process to the Ray cluster at `address` (nothing to do when already connected),
    after a trial connection in a child process (`trial_connect`; `trial` False: the caller is such a
    child already, the service's Ray driver). Not for a `ray://` address: each Ray Client connection
    starts a server process on the head, and a trial one doubled that (past 30 s under load). That
    server may still miss the head's deadline (RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S, 30 s) on a
    loaded head: Ray Client then fails with "Initialization failure from server" and has disconnected,
    so the connection is tried again, CLIENT_INIT_RETRIES times, with a warning."""
    ray = _ray(flag)
    if ray.is_initialized():
        return
    probe(address, flag)
    if trial and not address.startswith("ray://"):  # Ray Client: a server per connection, slow to start
        trial_connect(address, flag)
    retries = CLIENT_INIT_RETRIES if address.startswith("ray://") else 0
    for attempt in range(retries + 1):
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, namespace="recycle")
            return
        except ConnectionAbortedError as exc:  # Ray Client: the head's server for us did not start in time
            if attempt == retries:
                raise InvalidInputError(f"{flag} {address}: cannot connect: {_first_line(exc)}") from None
            log.warning("%s %s: %s; connecting again", flag, address, _first_line(exc))
        except Exception as exc:
            raise InvalidInputError(f"{flag} {address}: cannot connect: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def lost_errors() -> tuple[type[BaseException], ...]:
    """Ray's errors of a task lost with its worker or its node (worth submitting again), as opposed
    to a task that raised (the same error on every try)."""
    from ray import exceptions as rx

    return (
        rx.WorkerCrashedError,
        rx.NodeDiedError,
        rx.ObjectLostError,  # incl. a result whose node died before it was fetched
        rx.LocalRayletDiedError,
        rx.OutOfMemoryError,
    )


def in_flight(ray: Any) -> int:
    """How many tasks to keep submitted: enough to keep every CPU of the cluster busy, and few enough
    that each `ray.wait` over them stays cheap with thousands of scenarios."""
    return max(16, 4 * int(ray.cluster_resources().get("CPU", 1)))


def plan_on_ray(
    address: str,
    job_json: str,
    scenarios: list[FailureScenario],
    use_cpsat: bool,
    time_limit_s: float,
    record: Callable[[dict[str, Any]], None],
) -> int:
    """Plan `scenarios` as Ray tasks, passing each record to `record` as it finishes; returns how many
    tasks were submitted again after their worker or node died."""
    ray = _ray()
    connect(address)
    from ray import exceptions as rx

    from whatif.precompute import _plan_task

    lost_types = lost_errors()
    # max_retries=0: resubmitted here, so a lost result is retried too and each retry is reported
    task = ray.remote(num_cpus=1, max_retries=0)(_plan_task)
    job_ref = ray.put(job_json)

    def submit(scenario_json: str) -> Any:
        return task.remote(job_ref, scenario_json, use_cpsat, time_limit_s)

    queue = [s.model_dump_json() for s in reversed(scenarios)]  # popped from the end: in order
    pending: dict[Any, tuple[str, int]] = {}  # in flight: ref -> (scenario, resubmissions so far)
    retried, window, window_at = 0, 0, -math.inf
    failures: list[tuple[str, BaseException]] = []  # scenarios whose task raised (not retried)
    while queue or pending:
        if time.monotonic() - window_at > WINDOW_REFRESH_S:  # the cluster may have grown
            window, window_at = in_flight(ray), time.monotonic()
        while queue and len(pending) < window:
            s_json = queue.pop()
            pending[submit(s_json)] = (s_json, 0)
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            s_json, attempt = pending.pop(ref)
            try:
                rec = ray.get(ref)
            except lost_types as exc:
                if attempt >= RETRIES:
                    failures.append((s_json, exc))
                    continue
                log.warning(
                    "precompute on Ray: a scenario was lost with its worker or node (%s); submitting it "
                    "again (retry %d of %d)",
                    type(exc).__name__,
                    attempt + 1,
                    RETRIES,
                )
                pending[submit(s_json)] = (s_json, attempt + 1)
                retried += 1
                continue
            except rx.RayError as exc:
                if "ModuleNotFoundError" in str(exc):
                    raise InvalidInputError(
                        f"{FLAG} {address}: the Ray workers cannot import recycle; pip install it into the "
                        "Python that runs `ray start` on every node"
                    ) from None
                if not isinstance(exc, rx.RayTaskError):
                    raise
                cause = getattr(exc, "cause", None)  # the task's own exception (a planner error)
                failures.append((s_json, cause if isinstance(cause, BaseException) else exc))
                log.warning("precompute on Ray: a scenario failed (%s); going on with the others", s_json)
                continue
            record(rec)
    if failures:
        raise ScenariosFailed(failures)
    return retried
