"""`recycle worker` and `recycle launch`: parsers and commands (wired into planner/cli.py by the lead).

Also runnable alone: `python -m runtime_adapter.cli worker ...` (what the launcher starts).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

from planner.contract import Schedule
from planner.errors import InvalidInputError
from runtime_adapter.assignment import Worker
from runtime_adapter.cli_inputs import (
    check_schedules_dir,
    check_worker,
    parse_fail_at,
    parse_store,
    read_job,
    read_model,
)

# torch-heavy modules are imported inside the commands: building the `recycle` parser must not load torch.


def add_worker_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle worker`: one worker process."""
    p = sub.add_parser("worker", help="run one worker [d, s] of a job (gloo on CPU, nccl on GPUs)")
    p.add_argument("--job", required=True, help="job spec JSON (CONTRACT.md section 1)")
    p.add_argument("--pipeline", type=int, required=True)
    p.add_argument("--stage", type=int, required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--schedule-file", help="schedule envelope file {version, schedule}")
    src.add_argument("--service", help="planner service URL (with --job-id and --token)")
    p.add_argument("--job-id")
    p.add_argument("--token")
    p.add_argument("--store", required=True, help="host:port of the rendezvous TCPStore")
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--model", default="{}", help="GPTConfig fields as JSON")
    p.add_argument("--out", required=True, help="directory for final parameters and accounting")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--rejoin", action="store_true", help="fetch state from a peer instead of initialising")
    p.add_argument("--standby-key", help="warm standby: join once the launcher sets this store key")
    p.add_argument("--fail-at", help="fault injection: ITERATION:PHASE (F, B, W, BW, OPT) -> SIGKILL self")
    add_checkpoint_args(p)
    p.add_argument("--resume", action="store_true", help="start from the newest complete checkpoint")
    p.add_argument("--pace-ms", type=float, default=0.0, help="make each iteration last at least this long")
    p.set_defaults(func=cmd_worker)


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """--checkpoint-dir and --checkpoint-every (default $RECYCLE_CHECKPOINT_EVERY, else 0: none)."""
    p.add_argument("--checkpoint-dir", help="directory of the periodic checkpoints (stage<s>/it<k>.pt)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=int(os.environ.get("RECYCLE_CHECKPOINT_EVERY", "0")),
        help="stepped iterations between checkpoints (default $RECYCLE_CHECKPOINT_EVERY or 0: none)",
    )


def cmd_worker(args: argparse.Namespace) -> int:
    """Run one worker until the job's iterations are done."""
    from runtime_adapter.client import FileScheduleSource, HttpScheduleSource, ScheduleSource
    from runtime_adapter.worker import WorkerOptions, WorkerProcess, install_log_prefix

    job = read_job(args.job)
    worker = check_worker(job, (args.pipeline, args.stage))
    host, port = parse_store(args.store)
    fail_at, cfg = parse_fail_at(args.fail_at), read_model(args.model)
    install_log_prefix(worker)
    opts = WorkerOptions(
        worker=worker,
        num_pipelines=job.num_pipelines,
        num_stages=job.num_stages,
        num_microbatches=job.num_microbatches,
        num_iterations=args.iterations,
        cfg=cfg,
        store_host=host,
        store_port=port,
        out_dir=Path(args.out),
        backend=args.backend,
        rejoin=args.rejoin,
        fail_at=fail_at,
        standby_key=args.standby_key,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        pace_ms=args.pace_ms,
    )
    source: ScheduleSource
    if args.schedule_file:
        source = FileScheduleSource(Path(args.schedule_file), worker, job.num_pipelines, job.num_microbatches)
    else:
        if not (args.job_id and args.token):
            print("recycle worker: --service needs --job-id and --token", file=sys.stderr)
            return 2
        source = HttpScheduleSource(
            args.service,
            args.job_id,
            args.token,
            worker,
            job.num_pipelines,
            job.num_stages,
            job.num_microbatches,
        )
    code = WorkerProcess(opts, source).run()
    # Groups of older versions may still have a wait blocked in C++: leave without running their
    # destructors (which would abort the process after the work is done and saved).
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)


def add_launch_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle launch`: a whole D x P job on this machine."""
    p = sub.add_parser("launch", help="start D x P workers here; survivors keep going when one dies")
    p.add_argument("--job", required=True, help="job spec JSON")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--schedules",
        help="directory of schedules named failed-none.json, failed-1.1.json, failed-0.2-1.1.json ...",
    )
    src.add_argument("--service", help="planner service URL: register the job there and be its controller")
    p.add_argument("--controller-token", help="controller token (default $RECYCLE_CONTROLLER_TOKEN)")
    p.add_argument("--max-failures", type=int, default=1, help="with --service: failures to precompute")
    p.add_argument("--heartbeat-timeout", type=float, help="with --service: silence that fails a worker (s)")
    add_checkpoint_args(p)
    p.add_argument("--pace-ms", type=float, default=0.0, help="make each iteration last at least this long")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--model", default="{}", help="GPTConfig fields as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before everything is killed")
    p.add_argument("--dry-run", action="store_true", help="print the worker commands and exit")
    p.set_defaults(func=cmd_launch)


def schedule_file_name(failed: frozenset[Worker]) -> str:
    """File name of the schedule for a failure set in a --schedules directory."""
    if not failed:
        return "failed-none.json"
    return "failed-" + "-".join(f"{d}.{s}" for d, s in sorted(failed)) + ".json"


def cmd_launch(args: argparse.Namespace) -> int:
    """Start the job, supervise it, print each worker's exit code."""
    from runtime_adapter.launch import Launcher, LaunchSpec
    from runtime_adapter.progress import StepProgress
    from runtime_adapter.publishers import FilePublisher, Publisher, PublisherError, ServicePublisher

    job = read_job(args.job)
    spec = LaunchSpec(
        job,
        read_model(args.model),
        args.iterations,
        Path(args.out),
        args.backend,
        checkpoint_every=args.checkpoint_every,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        pace_ms=args.pace_ms,
    )
    if args.dry_run:
        placeholders = ["--service", args.service, "--job-id", "<job id>", "--token", "<worker token>"]
        print(spec.dry_run(source_args=placeholders if args.service else None))
        return 0
    publisher: Publisher
    if args.service:
        token = args.controller_token or os.environ.get("RECYCLE_CONTROLLER_TOKEN")
        if not token:
            print(
                "recycle launch: --service needs --controller-token or RECYCLE_CONTROLLER_TOKEN",
                file=sys.stderr,
            )
            return 2
        publisher = ServicePublisher(
            args.service, token, job, args.max_failures, heartbeat_timeout_s=args.heartbeat_timeout
        )
    else:
        directory = check_schedules_dir(args.schedules, schedule_file_name(frozenset()))

        def schedule_for(failed: frozenset[Worker]) -> Schedule:
            path = directory / schedule_file_name(failed)
            try:
                return Schedule.model_validate_json(path.read_text())
            except (OSError, ValueError) as e:
                raise PublisherError(f"no usable schedule for failed {sorted(failed)}: {path}: {e}") from e

        publisher = FilePublisher(spec.out_dir / "schedule.json", job, schedule_for)
    launcher = Launcher(spec, publisher=publisher)
    progress = StepProgress(spec.out_dir, spec.workers())

    def report(lr: Launcher) -> None:
        line = progress.line(lr.version, lr.failed, spec.num_iterations)
        if line is not None:
            print(line, file=sys.stderr, flush=True)

    try:
        launcher.start()
        codes = launcher.wait(timedelta(seconds=args.timeout), report)
    except (PublisherError, TimeoutError) as e:
        launcher.terminate()
        print(f"recycle launch: {e} (logs in {spec.out_dir})", file=sys.stderr)
        return 1
    for w, rc in sorted(codes.items()):
        print(f"worker {list(w)}: exit {rc}")
    return 0 if all(rc == 0 for w, rc in codes.items() if w not in launcher.failed) else 1


def add_profile_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle profile`: measure the stages of the reference model here and write a job spec."""
    p = sub.add_parser("profile", help="measure per-stage F/B/W/OPT times and memory; write a job spec")
    p.add_argument("--model", default="{}", help="GPTConfig fields as JSON")
    p.add_argument("--stages", type=int, required=True, help="P, pipeline stages")
    p.add_argument("--pipelines", type=int, default=1, help="D, data-parallel pipelines")
    p.add_argument("--microbatches", type=int, default=4, help="M, micro-batches per pipeline")
    p.add_argument(
        "--memory-gib",
        type=float,
        help="memory_capacity_mib per worker, in GiB (default: this machine's RAM / (D*P))",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per op (median), after 2 warm-ups")
    p.add_argument("--threads", type=int, default=1, help="torch threads (workers run with 1)")
    p.add_argument("-o", "--out", help="write the job spec here (default: stdout only shows the table)")
    p.add_argument("--name", help="job name (default: gpt-d<D>p<P>m<M>)")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile every stage, print a per-stage table (progress on stderr), write the job spec."""
    from runtime_adapter.profile import format_table, job_spec_from_profile, measure_comm, profile_stages

    def fail(msg: str) -> int:
        print(f"recycle profile: {msg}", file=sys.stderr)
        return 2

    cfg = read_model(args.model)
    D, P, M = args.pipelines, args.stages, args.microbatches
    if min(D, P, M, args.repeats, args.threads) < 1:
        return fail("--stages, --pipelines, --microbatches, --repeats and --threads must be at least 1")
    if cfg.num_layers < P:
        return fail(f"--stages {P} is more than the model's {cfg.num_layers} layers (one block per stage)")
    if args.memory_gib is not None and args.memory_gib <= 0:
        return fail(f"--memory-gib must be positive, not {args.memory_gib}")
    if args.memory_gib is not None:
        capacity = args.memory_gib * 1024.0
    else:
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / float(1 << 20) / (D * P)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr)

    stages = profile_stages(cfg, P, D, M, repeats=args.repeats, threads=args.threads, progress=progress)
    progress("measuring the activation hop and the stage all-reduces (gloo, loopback)")
    comm = measure_comm(cfg, stages, D, M, args.repeats)
    job = job_spec_from_profile(args.name or f"gpt-d{D}p{P}m{M}", stages, comm, D, M, capacity)
    print(format_table(stages, comm))
    if args.out:
        Path(args.out).write_text(job.model_dump_json(indent=2) + "\n")
        print(f"job spec written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m runtime_adapter.cli`."""
    parser = argparse.ArgumentParser(prog="recycle-runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    add_worker_parser(sub)
    add_launch_parser(sub)
    add_profile_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return int(args.func(args))
    except InvalidInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
