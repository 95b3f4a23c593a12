"""`recycle agent`: its flags, the checks made before any worker starts, and what it prints.

    recycle agent --service URL --job-id ID --token TOKEN --workers "d,s;d,s" --store HOST:PORT \\
        --iterations N [--out DIR] [--checkpoint-dir DIR_OR_URL] [--checkpoint-every N] ...

Before any worker starts: every number, the workers (`d,s` pairs on the job's grid, no repeats), the
store (a rendezvous store answers at HOST:PORT), the service (reachable, the token valid for the job,
the job exists; the job spec comes from it) and
the training (--entry/--model: every stage builds on the meta device). Bad input is one line on stderr
and exit 2 with no worker started. Then it supervises (agent.py); exit 0 when every worker of it
finished (or the job finished without a failed one), 1 when it gives up (the service refused it, a
worker's start-up error), 2 when a worker rejected its input, 130/143 on SIGINT/SIGTERM: every worker
it started is stopped first.

Also runnable alone: `python -m runtime_adapter.agent_cli agent ...`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from planner.cli_io import check_output_dir
from planner.errors import InvalidInputError
from runtime_adapter.assignment import Worker
from runtime_adapter.backoff import Backoff
from runtime_adapter.cli_inputs import (
    add_checkpoint_args,
    add_model_args,
    check_min,
    check_worker,
    parse_kwargs,
    parse_store,
    resolve_checkpoint_every,
    service_url,
)

if TYPE_CHECKING:
    from planner.contract import JobSpec
    from runtime_adapter.supervisor import Supervisor

logger = logging.getLogger(__name__)

T = TypeVar("T")

SERVICE_CHECK_S = 10.0  # how long the check before start waits for the service's answer


def add_agent_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle agent`: one host's workers of a service job."""
    p = sub.add_parser(
        "agent", help="start and supervise this host's workers of a job on the planner service"
    )
    p.add_argument("--service", type=service_url, required=True, help="planner service URL")
    p.add_argument("--job-id", required=True, help="the job's id on the service")
    p.add_argument("--token", required=True, help="the job's worker token (or the controller token)")
    p.add_argument("--workers", required=True, help='this host\'s workers as "d,s;d,s" (pipeline,stage)')
    p.add_argument("--store", required=True, metavar="HOST:PORT", help="the job's rendezvous store")
    p.add_argument(
        "--iterations", required=True, help="iterations to train (every agent of the job: the same)"
    )
    p.add_argument(
        "--out", help="directory for logs, accounting, final parameters (default ./recycle-<job id>)"
    )
    add_checkpoint_args(p)  # --checkpoint-dir: a shared directory or an fsspec URL (every host reads it)
    add_model_args(p)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "auto"], help="default gloo")
    p.add_argument(
        "--device", default="cpu", help="cpu (default), cuda (cuda:<LOCAL_RANK %% devices>), cuda:N, auto"
    )
    p.add_argument("--agent-id", help="this agent's name in event ids (default: the host name)")
    p.add_argument(
        "--standby",
        action="store_true",
        help="keep a warm standby per worker; it re-joins when that worker dies",
    )
    p.add_argument(
        "--no-rejoin", action="store_true", help="do not restart a worker the schedule dropped (it lived)"
    )
    p.add_argument("--max-rejoins", default="3", help="re-joins of a dropped worker, per worker (default 3)")
    p.add_argument(
        "--pace-ms", default="0", help="make each iteration last at least this long (tests, demos)"
    )
    p.add_argument(
        "--wait",
        default="30",
        help="seconds to wait at start for the service and the store to answer (they may be starting "
        "at the same time as the agents; default 30); a refusal (token, job) ends it at once",
    )
    p.set_defaults(func=cmd_agent)  # fmt: skip


def _number(flag: str, text: str, low: float, kind: type = int) -> Any:
    """A number flag (one-line error, not argparse's usage text) at least `low`."""
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise InvalidInputError(
            f"{flag} {text!r}: not {'an integer' if kind is int else 'a number'}"
        ) from None
    if not math.isfinite(value):
        raise InvalidInputError(f"{flag} {text!r}: not a finite number")
    check_min(flag, value, low)
    return value


def parse_workers(text: str) -> list[Worker]:
    """--workers "d,s;d,s": at least one pair, no repeats."""
    out: list[Worker] = []
    for part in text.split(";"):
        d, sep, s = part.strip().partition(",")
        if not sep or not d.strip().isdigit() or not s.strip().isdigit():
            raise InvalidInputError(f'--workers {text!r}: expected "d,s;d,s" (pipeline,stage pairs)')
        w = (int(d), int(s))
        if w in out:
            raise InvalidInputError(f"--workers {text!r}: worker [{w[0]}, {w[1]}] is given twice")
        out.append(w)
    return out


def fetch_job(service: str, job_id: str, token: str) -> dict[str, Any]:
    """GET /v1/jobs/{id} with the token; InvalidInputError (one line) when that cannot be done."""
    url = f"{service.rstrip('/')}/v1/jobs/{job_id}"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=SERVICE_CHECK_S) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise InvalidInputError(f"--token: the service at {service} refused it (HTTP 401)") from None
        if e.code == 403:
            raise InvalidInputError(f"--token: not a token of job {job_id} (HTTP 403)") from None
        if e.code == 404:
            raise InvalidInputError(f"--job-id {job_id}: no such job on {service} (HTTP 404)") from None
        if e.code >= 500:  # starting, or a proxy in front of it
            raise Unreachable(f"--service {service}: GET {url} answered HTTP {e.code}") from None
        raise InvalidInputError(f"--service {service}: GET {url} answered HTTP {e.code}") from None
    except (OSError, ValueError) as e:  # URLError, refused, timeout, a page that is not JSON
        reason = getattr(e, "reason", e)
        raise Unreachable(f"--service {service}: not reachable as the planner service ({reason})") from None
    if not isinstance(doc, dict):
        raise InvalidInputError(f"--service {service}: GET {url} did not answer a job")
    return doc


class Unreachable(InvalidInputError):
    """The service or the store does not answer (yet): worth waiting for, unlike a refusal."""


def _job_spec(args: argparse.Namespace, doc: dict[str, Any]) -> JobSpec:
    from planner.contract import JobSpec

    if not isinstance(doc.get("job"), dict):
        raise InvalidInputError(f"--service {args.service}: its answer for job {args.job_id} has no job spec")
    return JobSpec.model_validate(doc["job"])


def _waiting(what: str, wait_s: float, check: Callable[[], T]) -> T:
    """`check()`, retried while it raises Unreachable, for up to `wait_s` seconds (a line on stderr
    when it starts waiting); the last Unreachable after that."""
    deadline, said = time.monotonic() + wait_s, False
    backoff = Backoff(0.2, 2.0)
    while True:
        try:
            return check()
        except Unreachable:
            if time.monotonic() >= deadline:
                raise
            if not said:
                print(f"recycle agent: waiting up to {wait_s:g} s for {what}", file=sys.stderr, flush=True)
                said = True
            time.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))


def _check(args: argparse.Namespace) -> tuple[JobSpec, list[Worker], dict[str, Any], tuple[str, int]]:
    """Every check before start (InvalidInputError: one line, exit 2)."""
    from runtime_adapter.launch_cli import _check_store

    wait_s = _number("--wait", args.wait, 0, float)
    args.iterations = _number("--iterations", args.iterations, 1)
    args.checkpoint_every = resolve_checkpoint_every(args.checkpoint_every)
    check_min("--checkpoint-every", args.checkpoint_every, 0)
    args.max_rejoins = _number("--max-rejoins", args.max_rejoins, 0)
    args.pace_ms = _number("--pace-ms", args.pace_ms, 0, float)
    workers, model, store = parse_workers(args.workers), parse_kwargs(args.model), parse_store(args.store)
    if args.agent_id is not None and not args.agent_id.strip():
        raise InvalidInputError("--agent-id must not be empty")
    doc = _waiting(
        f"the service at {args.service}", wait_s, lambda: fetch_job(args.service, args.job_id, args.token)
    )
    job = _job_spec(args, doc)
    for w in workers:
        check_worker(job, w)
    if doc.get("state") == "finished":
        raise InvalidInputError(f"job {args.job_id} is finished: nothing to run")

    def check_store() -> None:
        try:
            _check_store(store)
        except InvalidInputError as e:
            raise Unreachable(str(e)) from None

    _waiting(f"the store at {args.store}", wait_s, check_store)
    return job, workers, model, store


def _printer(job_id: str) -> Any:
    """on_tick: a line per death, re-join and restore of this agent's workers."""
    seen = [0]

    def tick(sup: Supervisor) -> None:
        from runtime_adapter.summary import event_line

        for ev in sup.history[seen[0] :]:
            print(event_line(ev, f"reported to job {job_id}"), flush=True)
        seen[0] = len(sup.history)

    return tick


def cmd_agent(args: argparse.Namespace) -> int:
    """Check everything, start this host's workers, supervise them until they are done."""
    from runtime_adapter.agent import Agent
    from runtime_adapter.launch_cli import _check_training, checkpoint_location
    from runtime_adapter.launch_spec import LaunchSpec
    from runtime_adapter.publishers import PublisherError
    from runtime_adapter.service_publisher import ServicePublisher
    from runtime_adapter.stop_signals import stop_on_signals
    from runtime_adapter.supervisor import LaunchError, WorkerStartupError

    def fail(msg: str, code: int) -> int:
        print(f"recycle agent: {msg}", file=sys.stderr, flush=True)
        return code

    job, workers, model, store = _check(args)
    device, backend = _check_training(args, job, model)
    agent_id = args.agent_id or socket.gethostname()
    out = Path(args.out or f"recycle-{args.job_id}")
    check_output_dir(str(out), "--out")  # not a regular file: one line, exit 2, before anything starts
    spec = LaunchSpec(job, model, args.iterations, out, backend, entry=args.entry, device=device,
                      check_data=args.check_data, checkpoint_every=args.checkpoint_every,
                      checkpoint_dir=checkpoint_location(args.checkpoint_dir), pace_ms=args.pace_ms,
                      store=store, run_id=args.job_id)  # fmt: skip
    service = ServicePublisher(args.service, args.token, job, job_id=args.job_id, worker_token=args.token)
    agent = Agent(spec, service, workers, agent_id, rejoin=not args.no_rejoin, max_rejoins=args.max_rejoins,
                  standby=args.standby)  # fmt: skip
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    stop_on_signals()
    print(f"recycle agent {agent_id}: job {args.job_id}, workers {[list(w) for w in workers]}, "
          f"iterations 0..{args.iterations - 1}; outputs in {out}", flush=True)  # fmt: skip
    try:
        agent.start()
        codes = agent.run(_printer(args.job_id))
    except WorkerStartupError as e:
        return fail(str(e), 2 if e.code == 2 else 1)
    except (LaunchError, PublisherError, OSError) as e:
        return fail(f"{e} (logs in {out})", 1)
    except KeyboardInterrupt:
        return fail("interrupted: every worker stopped", 130)
    except SystemExit as e:
        return fail("stopped by a signal: every worker stopped", int(e.code or 1))
    finally:
        agent.terminate()
        service.finish()
    for w, rc in sorted(codes.items()):
        note = "" if rc == 0 else " (failed; the job went on without it)"
        print(f"worker {list(w)}: exit {rc}{note}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m runtime_adapter.agent_cli agent ...`."""
    from planner.cli import parse_args  # refuses `--X=--` as `recycle agent` does

    parser = argparse.ArgumentParser(prog="recycle")
    sub = parser.add_subparsers(dest="command", required=True)
    add_agent_parser(sub)
    args = parse_args(parser, argv)
    try:
        return int(args.func(args))
    except InvalidInputError as e:
        print(f"recycle agent: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
