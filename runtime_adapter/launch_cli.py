"""`recycle launch`: its flags, the checks made before anything starts, and what it prints.

Before any process starts: the job spec, the entry point and its model (every stage builds on the meta
device, the data function is deterministic on a few micro-batches), the device, every numeric flag, the
store (the port to host it on, or with --store an external store that answers), a fresh --out, and the
schedules (a precompute directory for this very job, or named schedule files that fit it) are checked;
bad input is one line on stderr and exit 2. Then it prints
where every output goes, the job id and page with --service, one line per iteration with the loss
(also appended to <out>/loss.csv), a line for every failure, re-join and restore, and a summary
(summary.py). Exit 0 when every worker that did not fail finished; 1 when the job could not go on
(a stage lost with no checkpoint, no schedule for a failure set, the service refused, timeout); a
worker that stopped during start-up with an error stops the launch with its error (exit 2 if the
worker rejected its input, else 1).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.cli_io import finite_float
from planner.errors import InvalidInputError
from runtime_adapter.cli_inputs import (
    add_checkpoint_args,
    add_model_args,
    check_fresh_out,
    check_min,
    check_resumable,
    check_store_port,
    parse_kwargs,
    parse_store,
    read_job,
    resolve_checkpoint_every,
    service_url,
)
from runtime_adapter.settings import runtime_settings

if TYPE_CHECKING:
    from planner.contract import JobSpec
    from runtime_adapter.launch import Launcher, LaunchSpec
    from runtime_adapter.progress import JobMonitor
    from runtime_adapter.publishers import Publisher
    from runtime_adapter.supervisor import Supervisor

logger = logging.getLogger(__name__)

STORE_CHECK = timedelta(seconds=5)  # --store: how long the check before start waits for an answer


def add_launch_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle launch`: a whole D x P job on this machine."""
    p = sub.add_parser("launch", help="start D x P workers here; survivors keep going when one dies")
    p.add_argument("--job", required=True, help="job spec JSON (docs/contract.md section 1)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--schedules",
        metavar="DIR",
        help="plans from `recycle precompute JOB -o DIR` (for this job spec), or hand-made schedules "
        "named failed-none.json, failed-1.1.json, failed-0.2-1.1.json (failed workers d.s, sorted)",
    )
    src.add_argument(
        "--service",
        type=service_url,
        help="planner service URL: register the job there and be its controller",
    )
    p.add_argument(
        "--plan-on-demand",
        action="store_true",
        help="with --schedules: plan a failure set DIR has no plan for when it happens (greedy, up to a few "
        "seconds) and add it to DIR; DIR may then be new",
    )
    p.add_argument("--controller-token", help="controller token (default $RECYCLE_CONTROLLER_TOKEN)")
    p.add_argument(
        "--max-failures",
        type=int,
        default=None,
        help="with --service: the service precomputes plans for every failure set of up to this many "
        "failed workers (default 1); larger sets are planned when they happen",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=finite_float,
        help="silence that fails a worker (s): with --service the service's (default its "
        "RECYCLE_HEARTBEAT_TIMEOUT_S), with --schedules the launcher ends a worker that stopped polling "
        "the schedule file that long (default 30)",
    )
    p.add_argument(
        "--repartition",
        action="store_true",
        help="with --service: the service's plans also move layers off the stages that lost workers "
        "(and back on re-join); needs per-layer figures in --job (`recycle profile --layers`) and an "
        "entry whose Training has layer_ranges (the reference GPT has them)",
    )
    add_checkpoint_args(p)
    p.add_argument(
        "--pace-ms",
        type=finite_float,
        default=0.0,
        help="make each iteration last at least this long (default 0)",
    )
    p.add_argument("--iterations", type=int, default=10, help="iterations to train (default 10)")
    add_model_args(p)
    p.add_argument(
        "--out",
        required=True,
        help="new directory for logs, accounting, loss.csv, final parameters (with --resume: the earlier "
        "launch's)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on with the earlier launch of this job in --out (its launcher was killed or stopped) "
        "from its newest complete checkpoint: the same --job, --schedules and checkpointing as then",
    )
    p.add_argument(
        "--backend",
        default="gloo",
        choices=["gloo", "nccl", "auto"],
        help="gloo (default), nccl, or auto: nccl with one worker per CUDA device, else gloo",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda (worker i on cuda:<i %% devices>), cuda:N or auto (cuda if available)",
    )
    p.add_argument(
        "--store-port",
        type=int,
        default=None,
        help="port of the rendezvous store the launcher hosts on 127.0.0.1 (default 0: a free one)",
    )
    p.add_argument(
        "--store",
        metavar="HOST:PORT",
        help="use the rendezvous store at HOST:PORT (e.g. a `recycle store`, which may be restarted "
        "mid-run) instead of hosting one; not with --store-port",
    )
    p.add_argument("--print-every", type=int, default=1, help="print the loss every N iterations (default 1)")
    p.add_argument(
        "--timeout", type=finite_float, help="seconds after which every worker is killed (default: no limit)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="check the inputs, print the worker commands and exit"
    )
    p.set_defaults(func=cmd_launch)


def checkpoint_location(text: str | None) -> Path | str | None:
    """--checkpoint-dir: an fsspec URL (scheme://...) stays a string, anything else is a path."""
    if not text:
        return None
    return text if "://" in text else Path(text)


def _check_flags(args: argparse.Namespace) -> None:
    check_min("--iterations", args.iterations, 1)
    args.checkpoint_every = resolve_checkpoint_every(args.checkpoint_every)
    check_min("--checkpoint-every", args.checkpoint_every, 0)
    check_min("--pace-ms", args.pace_ms, 0)
    if args.max_failures is not None and not args.service:
        raise InvalidInputError("--max-failures: only with --service (the service precomputes)")
    args.max_failures = 1 if args.max_failures is None else args.max_failures
    check_min("--max-failures", args.max_failures, 0)
    check_min("--heartbeat-timeout", args.heartbeat_timeout, 0, strict=True)
    check_min("--timeout", args.timeout, 0, strict=True)
    check_min("--print-every", args.print_every, 1)
    if args.store is None:
        args.store_port = 0 if args.store_port is None else args.store_port
        check_store_port(args.store_port)
        return
    if args.store_port is not None:
        raise InvalidInputError(
            "--store and --store-port exclude each other (an external store, or one hosted here)"
        )
    args.store_port = 0
    _check_store(parse_store(args.store))


def _check_store(addr: tuple[str, int]) -> None:
    """--store HOST:PORT: a rendezvous store answers there now (before any process starts)."""
    from runtime_adapter.store import check_reachable

    failure = check_reachable(addr, STORE_CHECK)
    if failure is not None:
        raise InvalidInputError(
            f"--store {addr[0]}:{addr[1]}: no rendezvous store reachable there ({failure}); "
            "start one with `recycle store --host HOST --port PORT`"
        )


def _check_training(args: argparse.Namespace, job: JobSpec, model: dict[str, Any]) -> tuple[str, str]:
    """Load the entry and check it before any process starts (it builds every stage on the meta
    device and reads a few micro-batches twice); the workers' device spec and backend."""
    from runtime_adapter.devices import job_devices
    from runtime_adapter.entry import load_entry
    from runtime_adapter.stage import check_training

    training = load_entry(args.entry, model)
    check_training(training, job.num_stages, job.num_pipelines, job.num_microbatches)
    if getattr(args, "repartition", False):  # `recycle agent` attaches: the job says, not a flag
        _check_repartition(args, job, training.layer_ranges is not None)
    device, backend, why = job_devices(args.device, args.backend, job.num_pipelines * job.num_stages)
    if why:
        print(f"backend: {backend} ({why})")
    return device, backend


def _check_repartition(args: argparse.Namespace, job: JobSpec, has_layer_ranges: bool) -> None:
    """--repartition: with --service, a job spec with per-layer figures, a Training that can build a
    stage of any layer range."""
    from planner.partition import layer_model

    if not args.service:
        raise InvalidInputError("--repartition goes with --service (the service plans the layer moves)")
    if not has_layer_ranges:
        raise InvalidInputError(
            f"--repartition: the Training of --entry {args.entry} has no layer_ranges (layers cannot move)"
        )
    try:
        layer_model(job)  # the planner's per-layer figures (given, or derived from `model.layers`)
    except InvalidInputError as exc:
        raise InvalidInputError(f"--repartition: --job {args.job}: {exc}") from None


def _publisher(args: argparse.Namespace, spec: LaunchSpec) -> Publisher | str:
    """The publisher for --schedules or --service, or a one-line error (bad input)."""
    from runtime_adapter.heartbeats import DEFAULT_TIMEOUT_S
    from runtime_adapter.publishers import FilePublisher, ServicePublisher
    from runtime_adapter.schedules import open_schedules

    if args.schedules:
        source = open_schedules(args.schedules, spec.job, args.plan_on_demand)
        print(f"schedules: {source.describe()}")
        checkpoints = spec.checkpoints if spec.checkpoint_every > 0 else None  # restores need them
        timeout = DEFAULT_TIMEOUT_S if args.heartbeat_timeout is None else args.heartbeat_timeout
        return FilePublisher(spec.out_dir / "schedule.json", spec.job, source, checkpoints, timeout)
    if args.plan_on_demand:
        return "--plan-on-demand goes with --schedules (the service plans by itself)"
    env_token = runtime_settings().controller_token
    token = args.controller_token or (env_token.get_secret_value() if env_token else None)
    if not token:
        return "--service needs --controller-token or RECYCLE_CONTROLLER_TOKEN"
    moves = ", with re-partition" if args.repartition else ""
    print(
        f"schedules: from the planner service {args.service} (precomputed up to {args.max_failures} "
        f"failures{moves})"
    )
    policy = "auto" if spec.checkpoint_every > 0 else "manual"  # no checkpoints: a lost stage ends it
    return ServicePublisher(args.service, token, spec.job, args.max_failures,
                            heartbeat_timeout_s=args.heartbeat_timeout, restore_policy=policy,
                            repartition=args.repartition)  # fmt: skip


def _print_outputs(spec: LaunchSpec) -> None:
    out = spec.out_dir
    ckpt = (
        f"every {spec.checkpoint_every} iterations"
        if spec.checkpoint_every > 0
        else "off (--checkpoint-every N)"
    )
    print(f"recycle launch: job {spec.job.name!r}, {spec.job.num_pipelines} x {spec.job.num_stages} workers, "
          f"iterations 0..{spec.num_iterations - 1}; outputs in {out}:")  # fmt: skip
    print(f"  worker logs     {out}/worker_<d>_<s>.log (process ids in worker_<d>_<s>.pid)")
    print(f"  accounting      {out}/acct_<d>_<s>.jsonl (one JSON record per step, rollback, checkpoint)")
    print(f"  loss            {out}/loss.csv (iteration, loss, version) and loss.png at the end")
    print(f"  schedule        {out}/schedule.json (with --schedules: the version the workers poll)")
    print(f"  checkpoints     {spec.checkpoints}: {ckpt}")
    print(f"  final params    {out}/final_<d>_<s>.pt")


class _Reporter:
    """Prints the loss lines, the launcher's events and a status line when no loss came for 5 s."""

    def __init__(self, monitor: JobMonitor, spec: LaunchSpec, every: int) -> None:
        self.monitor, self.spec, self.every = monitor, spec, every
        self.seen_events, self.last_print = 0, time.monotonic()
        self.warned_nonfinite = False

    def __call__(self, lr: Supervisor) -> None:
        from runtime_adapter.summary import event_line

        self.monitor.poll()
        total = len(self.spec.workers())
        for ev in lr.history[self.seen_events :]:
            print(event_line(ev, f"schedule now v{lr.version}"), flush=True)
        self.seen_events = len(lr.history)
        last = self.spec.num_iterations - 1
        for row in self.monitor.new_losses():
            if not math.isfinite(row.loss) and not self.warned_nonfinite:
                self.warned_nonfinite = True  # once: every later iteration is likely the same
                print(f"warning: the loss of iteration {row.iteration} is {row.loss} (training diverged, or "
                      "the data or the model gives NaN/Inf); the launch trains on: Ctrl-C stops it",
                      file=sys.stderr, flush=True)  # fmt: skip
            if row.iteration % self.every == 0 or row.iteration == last:
                alive = total - len(lr.failed)
                print(f"iteration {row.iteration:>3}/{last}  loss {row.loss:.4f}  schedule v{row.version}  "
                      f"alive {alive}/{total}", flush=True)  # fmt: skip
            self.last_print = time.monotonic()
        if time.monotonic() - self.last_print > 5.0:
            print(self.monitor.status_line(lr.version, lr.failed, self.spec.num_iterations), flush=True)
            self.last_print = time.monotonic()


def _finish(publisher: Publisher) -> None:
    """Tell the publisher the job is over after the launcher stopped every worker (with --service:
    flush its queued events; the workers posted `done` themselves); best effort."""
    try:
        publisher.finish()
    except Exception as e:  # the launch is already failing: report, do not mask its error
        logger.warning("could not close the job with its publisher: %s", e)


def _plot(spec: LaunchSpec, monitor: JobMonitor, launcher: Launcher) -> None:
    """<out>/loss.png: the loss per iteration with every failure, re-join and restore marked (best
    effort: a plotting error must not change the launch's exit code)."""
    from runtime_adapter.loss_plot import write_loss_png

    if not monitor.losses:
        return
    losses = sorted((r.iteration, r.loss) for r in monitor.losses.values())
    try:
        path = write_loss_png(spec.out_dir / "loss.png", losses, launcher.history, title=spec.job.name,
                              times=monitor.loss_times)  # fmt: skip
        print(f"loss curve: {path}", flush=True)
    except Exception as e:
        logger.warning("could not draw the loss curve: %s", e)


def cmd_launch(args: argparse.Namespace) -> int:
    """Check everything, start the job, supervise it, print the training and a summary."""
    from runtime_adapter.launch import Launcher, LaunchError, LaunchSpec, WorkerStartupError
    from runtime_adapter.progress import LOSS_CSV, JobMonitor
    from runtime_adapter.publishers import (
        FilePublisher,
        PublisherError,
        RegistrationRefused,
        ServicePublisher,
    )
    from runtime_adapter.stop_signals import stop_on_signals
    from runtime_adapter.summary import summarize

    def fail(msg: str, code: int) -> int:
        print(f"recycle launch: {msg}", file=sys.stderr, flush=True)
        return code

    job, model = read_job(args.job), parse_kwargs(args.model)
    _check_flags(args)
    device, backend = _check_training(args, job, model)
    ckpt_dir = checkpoint_location(args.checkpoint_dir)
    spec = LaunchSpec(job, model, args.iterations, Path(args.out), backend, entry=args.entry, device=device,
                      check_data=args.check_data, checkpoint_every=args.checkpoint_every,
                      checkpoint_dir=ckpt_dir, pace_ms=args.pace_ms, store_port=args.store_port,
                      store=parse_store(args.store) if args.store else None)  # fmt: skip
    local = isinstance(spec.checkpoints, Path)  # a URL's earlier checkpoints are not looked for here
    if args.resume:
        check_resumable(spec.out_dir, job, bool(args.service), spec.checkpoint_every)
    else:
        check_fresh_out(spec.out_dir, Path(spec.checkpoints), spec.checkpoint_every > 0 and local)
    if args.dry_run and args.schedules and args.plan_on_demand:  # a dry run neither plans nor writes
        print(f"schedules: {args.schedules} (planned on demand when the job runs)")
        print(spec.dry_run())
        return 0
    publisher = _publisher(args, spec)
    if isinstance(publisher, str):
        return fail(publisher, 2)
    if args.dry_run:
        placeholders = ["--service", args.service, "--job-id", "<job id>", "--token", "<worker token>"]
        print(spec.dry_run(source_args=placeholders if args.service else None))
        return 0
    if args.resume:
        assert isinstance(publisher, FilePublisher)  # check_resumable: --schedules
        publisher.resume()
        # The monitor reads every accounting record from the start, the earlier launch's too, and
        # writes each iteration's loss once: a loss.csv left by the earlier launcher would repeat them.
        (spec.out_dir / LOSS_CSV).unlink(missing_ok=True)
    _print_outputs(spec)
    launcher = Launcher(spec, publisher=publisher, resume=args.resume)
    monitor = JobMonitor(spec.out_dir, job.num_pipelines, job.num_stages, job.num_microbatches)
    reporter = _Reporter(monitor, spec, args.print_every)
    code = 0
    stop_on_signals()  # before any worker starts: none is left behind (they trained on, orphaned)
    try:
        launcher.start()
        host, port = launcher.store_address
        external = " (external: the workers reconnect if it is restarted)" if spec.store else ""
        print(f"  store           {host}:{port}{external}", flush=True)
        if isinstance(publisher, ServicePublisher):
            print(f"service job {publisher.job_id}: page {args.service.rstrip('/')}/jobs/{publisher.job_id}"
                  " (open it with ?token=<controller token>)", flush=True)  # fmt: skip
        limit = timedelta(seconds=args.timeout) if args.timeout is not None else timedelta(days=3650)
        codes = launcher.wait(limit, reporter)
    except WorkerStartupError as e:
        _finish(publisher)
        return fail(str(e), 2 if e.code == 2 else 1)
    except RegistrationRefused as e:  # a wrong token, or a job or flag the service's limits refuse
        launcher.terminate()
        return fail(str(e), 2)
    except (LaunchError, PublisherError, TimeoutError, OSError) as e:
        launcher.terminate()
        _finish(publisher)
        code = fail(f"{e} (logs in {spec.out_dir})", 1)
        codes = {w: int(p.returncode if p.returncode is not None else -1) for w, p in launcher.procs.items()}
    except KeyboardInterrupt:
        launcher.terminate()
        _finish(publisher)
        code = fail("interrupted: every worker stopped", 130)
        codes = {}
    except SystemExit as e:  # SIGTERM, SIGHUP (stop_on_signals)
        launcher.terminate()
        _finish(publisher)
        code = fail("stopped by a signal: every worker stopped", int(e.code or 1))
        codes = {}
    reporter(launcher)
    for w, rc in sorted(codes.items()):
        stopped = code and rc < 0 and w not in launcher.failed
        print(f"worker {list(w)}: exit {rc}" + (" (stopped by the launcher)" if stopped else ""))
    stepped = monitor.iterations_done(launcher.failed)
    last = monitor.last_loss()
    lines = summarize(launcher.history, monitor.version_seen, stepped, spec.num_iterations, launcher.version,
                      None if last is None else (last.iteration, last.loss))  # fmt: skip
    print("\n".join(lines), flush=True)
    _plot(spec, monitor, launcher)
    if code:
        return code
    return 0 if all(rc == 0 for w, rc in codes.items() if w not in launcher.failed) else 1
