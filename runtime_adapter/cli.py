"""`recycle worker` and `recycle launch`: parsers and commands (wired into planner/cli.py by the lead).

Also runnable alone: `python -m runtime_adapter.cli worker ...` (what the launcher starts).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

from planner.contract import JobSpec, Schedule
from runtime_adapter.assignment import Worker

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
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    from runtime_adapter.client import FileScheduleSource, HttpScheduleSource, ScheduleSource
    from runtime_adapter.model import GPTConfig

    """Run one worker until the job's iterations are done."""
    from runtime_adapter.worker import WorkerOptions, WorkerProcess, install_log_prefix

    job = JobSpec.model_validate_json(Path(args.job).read_text())
    worker: Worker = (args.pipeline, args.stage)
    install_log_prefix(worker)
    host, port = args.store.rsplit(":", 1)
    fail_at = None
    if args.fail_at:
        it, phase = args.fail_at.split(":")
        fail_at = (int(it), phase)
    opts = WorkerOptions(
        worker=worker,
        num_pipelines=job.num_pipelines,
        num_stages=job.num_stages,
        num_microbatches=job.num_microbatches,
        num_iterations=args.iterations,
        cfg=GPTConfig(**json.loads(args.model)),
        store_host=host,
        store_port=int(port),
        out_dir=Path(args.out),
        backend=args.backend,
        rejoin=args.rejoin,
        fail_at=fail_at,
        standby_key=args.standby_key,
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
    WorkerProcess(opts, source).run()
    # Groups of older versions may still have a wait blocked in C++: leave without running their
    # destructors (which would abort the process after the work is done and saved).
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


def add_launch_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle launch`: a whole D x P job on this machine."""
    p = sub.add_parser("launch", help="start D x P workers here; survivors keep going when one dies")
    p.add_argument("--job", required=True, help="job spec JSON")
    p.add_argument(
        "--schedules",
        required=True,
        help="directory of schedules named failed-none.json, failed-1.1.json, failed-0.2-1.1.json ...",
    )
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
    from runtime_adapter.launch import Launcher, LaunchSpec
    from runtime_adapter.model import GPTConfig

    """Start the job, supervise it, print each worker's exit code."""
    job = JobSpec.model_validate_json(Path(args.job).read_text())
    spec = LaunchSpec(job, GPTConfig(**json.loads(args.model)), args.iterations, Path(args.out), args.backend)
    if args.dry_run:
        print(spec.dry_run())
        return 0
    directory = Path(args.schedules)

    def schedule_for(failed: frozenset[Worker]) -> Schedule:
        return Schedule.model_validate_json((directory / schedule_file_name(failed)).read_text())

    launcher = Launcher(spec, schedule_for)
    launcher.start()
    codes = launcher.wait(timedelta(seconds=args.timeout))
    for w, rc in sorted(codes.items()):
        print(f"worker {list(w)}: exit {rc}")
    return 0 if all(rc == 0 for w, rc in codes.items() if w not in launcher.failed) else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m runtime_adapter.cli`."""
    parser = argparse.ArgumentParser(prog="recycle-runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    add_worker_parser(sub)
    add_launch_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
