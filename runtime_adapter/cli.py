"""`recycle worker`, `recycle launch`, `recycle store` and `recycle profile`: parsers and commands
(wired into the `recycle` dispatcher, recycle_cli; `recycle launch` itself is in launch_cli.py,
`recycle store` in store.py, `recycle agent` in agent_cli.py).

Also runnable alone: `python -m runtime_adapter.cli worker ...` (what the launcher starts).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

from planner.cli_io import check_output, check_output_dir, finite_float, write_output
from planner.errors import InvalidInputError
from runtime_adapter.cli_inputs import (
    DEFAULT_ENTRY,
    add_checkpoint_args,
    add_model_args,
    check_envelope_file,
    check_min,
    check_worker,
    parse_fail_at,
    parse_kwargs,
    parse_store,
    read_job,
    resolve_checkpoint_every,
    service_url,
)
from runtime_adapter.launch_cli import add_launch_parser, cmd_launch

__all__ = [
    "add_launch_parser",
    "add_profile_parser",
    "add_store_parser",
    "add_worker_parser",
    "cmd_launch",
    "cmd_store",
    "cmd_worker",
    "main",
]

# torch-heavy modules are imported inside the commands: building the `recycle` parser must not load torch.


def add_worker_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle worker`: one worker process."""
    p = sub.add_parser("worker", help="run one worker [d, s] of a job (gloo on CPU, nccl on GPUs)")
    p.add_argument("--job", required=True, help="job spec JSON (docs/contract.md section 1)")
    p.add_argument("--pipeline", type=int, required=True)
    p.add_argument("--stage", type=int, required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--schedule-file", help="schedule envelope file {version, schedule}")
    src.add_argument("--service", type=service_url, help="planner service URL (with --job-id and --token)")
    p.add_argument(
        "--heartbeat-dir",
        metavar="DIR",
        help="with --schedule-file: touch DIR/<d>_<s>.<pid> while polling it, so that whoever writes the "
        "file can tell this worker stopped (`recycle launch --schedules` passes it)",
    )
    p.add_argument("--job-id")
    p.add_argument("--token")
    p.add_argument("--store", required=True, help="host:port of the rendezvous TCPStore")
    p.add_argument(
        "--run-id",
        help="namespace of this run's store keys (default: the service job id; the launcher passes its own), "
        "so that jobs or relaunches sharing a long-lived store never meet",
    )
    p.add_argument("--iterations", type=int, required=True)
    add_model_args(p)
    p.add_argument("--out", required=True, help="directory for final parameters and accounting")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument(
        "--device", default="cpu", help="cpu, cuda (cuda:$LOCAL_RANK), cuda:N or auto (default cpu)"
    )
    p.add_argument("--rejoin", action="store_true", help="fetch state from a peer instead of initialising")
    p.add_argument("--standby-key", help="warm standby: join once the launcher sets this store key")
    p.add_argument(
        "--fail-at",
        help="fault injection: ITERATION:PHASE (F, B, W, BW, OPT, REDUCED: right after the gradient "
        "all-reduce, or MIGRATE: a layer migration is planned, no tensor moved yet) -> SIGKILL self",
    )
    add_checkpoint_args(p)
    p.add_argument("--resume", action="store_true", help="start from the newest complete checkpoint")
    p.add_argument(
        "--resume-at",
        metavar="K|none",
        help="a restore: start from exactly the checkpoint at stepped count K (none: the initial "
        "parameters; not with --resume)",
    )
    p.add_argument(
        "--restore-epoch",
        type=int,
        default=0,
        metavar="N",
        help="the restore epoch this process starts in (with --resume-at: it does not reload for it)",
    )
    p.add_argument(
        "--pace-ms", type=finite_float, default=0.0, help="make each iteration last at least this long"
    )
    p.add_argument(
        "--exit-with-parent",
        nargs="?",
        const=0,
        type=int,
        metavar="PID",
        help="end when the process that started this one (PID, if given: it must be this one's parent) "
        "dies, even by SIGKILL; launch and agent set it",
    )
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    """Run one worker until the job's iterations are done."""
    from runtime_adapter.client import FileScheduleSource, HttpScheduleSource, ScheduleSource
    from runtime_adapter.heartbeats import Heartbeat
    from runtime_adapter.worker import WaitTimeout, WorkerOptions, WorkerProcess, install_log_prefix

    job = read_job(args.job)
    worker = check_worker(job, (args.pipeline, args.stage))
    host, port = parse_store(args.store)
    fail_at, model = parse_fail_at(args.fail_at), parse_kwargs(args.model)
    check_min("--iterations", args.iterations, 1)
    parent = check_parent(args.exit_with_parent)
    args.checkpoint_every = resolve_checkpoint_every(args.checkpoint_every)
    check_min("--checkpoint-every", args.checkpoint_every, 0)
    check_min("--pace-ms", args.pace_ms, 0)
    check_min("--restore-epoch", args.restore_epoch, 0)
    resume_at = parse_resume_at(args.resume_at, args.resume, args.checkpoint_dir)
    check_output_dir(args.out, "--out")
    Path(args.out).mkdir(parents=True, exist_ok=True)  # a standalone worker: its accounting goes here
    if parent is not None:  # a worker whose launcher or agent is gone has no supervisor: it ends
        from planner.processes import exit_with_parent

        exit_with_parent(parent)
    opts = WorkerOptions(
        worker=worker,
        num_pipelines=job.num_pipelines,
        num_stages=job.num_stages,
        num_microbatches=job.num_microbatches,
        num_iterations=args.iterations,
        model=model,
        entry=args.entry,
        device=args.device,
        check_data=args.check_data,
        run_id=args.run_id or args.job_id or "",
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
        resume_at=resume_at,
        restore_epoch=args.restore_epoch,
        pace_ms=args.pace_ms,
    )
    source: ScheduleSource
    if args.schedule_file:
        check_envelope_file(Path(args.schedule_file))
        beat = Heartbeat(Path(args.heartbeat_dir), worker) if args.heartbeat_dir else None
        source = FileScheduleSource(
            Path(args.schedule_file), worker, job.num_pipelines, job.num_microbatches, heartbeat=beat
        )
    else:
        if args.heartbeat_dir:
            print("recycle worker: --heartbeat-dir goes with --schedule-file (the service is the heartbeat)",
                  file=sys.stderr)  # fmt: skip
            return 2
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
    remove_prefix = install_log_prefix(worker)
    try:
        process = WorkerProcess(opts, source)  # bad input (entry, device, split, data) raises here
    except BaseException:
        remove_prefix()  # (the process may go on: `main` run in-process)
        raise
    try:
        code = process.run()
    except InvalidInputError as e:  # found while training (--check-data): one line, exit 2
        logging.getLogger(__name__).error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except WaitTimeout as e:  # nothing came to run: one line, exit 1 (a launcher restarts or restores)
        logging.getLogger(__name__).error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        code = 1
    # Groups of older versions may still have a wait blocked in C++: leave without running their
    # destructors (which would abort the process after the work is done and saved).
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)


def check_parent(pid: int | None) -> int | None:
    """`--exit-with-parent[=PID]` -> the pid to watch (None: not given); InvalidInputError for a PID
    that is not this process's parent: its supervisor died before this line (it was adopted), or
    PID names another process (a wrapper such as srun in between)."""
    if pid is None:
        return None
    check_min("--exit-with-parent", pid, 0)
    if pid and pid != os.getppid():
        raise InvalidInputError(
            f"--exit-with-parent={pid}: process {pid} is not this worker's parent (process "
            f"{os.getppid()}): it is gone, or PID names another process"
        )
    return pid or os.getppid()


def parse_resume_at(text: str | None, resume: bool, checkpoint_dir: str | None) -> int | None:
    """`--resume-at K|none` -> K or None (also when absent); InvalidInputError for anything else."""
    if text is None or text == "none":
        if text is not None and resume:
            raise InvalidInputError("--resume-at and --resume exclude each other")
        return None
    if resume:
        raise InvalidInputError("--resume-at and --resume exclude each other")
    if not text.isdigit():
        raise InvalidInputError(f"--resume-at: {text!r} is not a stepped count (an integer >= 0) or 'none'")
    if not checkpoint_dir:
        raise InvalidInputError("--resume-at K needs --checkpoint-dir")
    return int(text)


def add_store_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle store`: the rendezvous store as a process of its own."""
    p = sub.add_parser(
        "store",
        help="host the rendezvous store (a TCPStore) until SIGTERM/SIGINT; restart it on the same address "
        "if it dies: running jobs carry on",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on, only that one (default 127.0.0.1; 0.0.0.0: every interface; the store "
        "has no authentication)",
    )
    p.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free one)")
    p.set_defaults(func=cmd_store)


def cmd_store(args: argparse.Namespace) -> int:
    """Print `store listening on HOST:PORT` and serve until SIGTERM/SIGINT (store.py)."""
    from runtime_adapter.store import cmd_store as run

    return run(args)


def add_profile_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle profile`: measure the stages of a Training (--entry; default the reference GPT) here and
    write a job spec."""
    p = sub.add_parser("profile", help="measure per-stage F/B/W/OPT times and memory; write a job spec")
    add_model_args(p, check_data=False)  # its checks read a few micro-batches twice anyway
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    p.add_argument("--stages", type=int, required=True, help="P, pipeline stages")
    p.add_argument("--pipelines", type=int, default=1, help="D, data-parallel pipelines")
    p.add_argument("--microbatches", type=int, default=4, help="M, micro-batches per pipeline")
    p.add_argument(
        "--memory-gib",
        type=finite_float,
        help="memory_capacity_mib per worker, in GiB (default: this machine's RAM / (D*P); on GPUs a "
        "device's memory / the workers sharing it)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per op (median), after 2 warm-ups")
    p.add_argument("--threads", type=int, default=1, help="torch threads (workers run with 1)")
    p.add_argument("-o", "--out", help="write the job spec here (default: stdout only shows the table)")
    p.add_argument(
        "--name", help="job name (default: gpt-d<D>p<P>m<M>; with --entry pkg.mod:fn, mod-d<D>...)"
    )
    p.add_argument(
        "--layers",
        action="store_true",
        help="also measure every layer (one layer per stage) and write the job spec's optional `layers` "
        "and `partition` (what `recycle plan --repartition` moves; docs/contract.md 1b); needs a Training "
        "with layer_ranges (the reference GPT has them)",
    )
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile every stage, print a per-stage table (progress on stderr), write the job spec."""
    import torch

    from runtime_adapter.devices import activate, resolve_device, workers_per_device
    from runtime_adapter.entry import load_entry
    from runtime_adapter.profile import profile_stages
    from runtime_adapter.profile_comm import format_table, job_spec_from_profile, measure_comm
    from runtime_adapter.stage import check_training

    D, P, M = args.pipelines, args.stages, args.microbatches
    check_min("--stages, --pipelines, --microbatches, --repeats and --threads", min(D, P, M, args.repeats,
              args.threads), 1)  # fmt: skip
    check_min("--memory-gib", args.memory_gib, 0, strict=True)
    check_output(args.out, "-o")
    training, device = load_entry(args.entry, parse_kwargs(args.model)), resolve_device(args.device)
    if args.layers and training.layer_ranges is None:
        raise InvalidInputError(f"--layers: {args.entry} has no layer_ranges (stages from layer ranges)")
    activate(device)
    shapes = check_training(training, P, D, M)
    if args.memory_gib is not None:
        capacity = args.memory_gib * 1024.0
    elif device.type == "cuda":  # the launch's placement: "cuda" spreads the workers over the GPUs
        sharing = workers_per_device(args.device, device, D * P)
        capacity = torch.cuda.get_device_properties(device).total_memory / float(1 << 20) / sharing
    else:
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / float(1 << 20) / (D * P)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr)

    progress(f"profiling {args.entry} on {device}")
    stages = profile_stages(training, P, D, M, repeats=args.repeats, threads=args.threads, progress=progress,
                            device=device)  # fmt: skip
    progress("measuring the activation hop and the stage all-reduces (gloo, loopback)")
    hop_shape = max(shapes, key=math.prod, default=(1,))
    comm = measure_comm(hop_shape, stages, D, M, args.repeats, training.boundary_dtype)
    model_name = "gpt" if args.entry == DEFAULT_ENTRY else args.entry.partition(":")[0].rsplit(".", 1)[-1]
    name = args.name or f"{model_name}-d{D}p{P}m{M}"
    job = job_spec_from_profile(name, stages, comm, D, M, capacity)
    print(format_table(stages, comm))
    doc = job.model_dump(mode="json")
    if args.layers:
        from runtime_adapter.profile_layers import profile_layers, with_layers

        progress("measuring every layer (one layer per stage)")
        layers = profile_layers(training, D, M, repeats=args.repeats, threads=args.threads, progress=progress,
                                device=device)  # fmt: skip
        doc = with_layers(doc, training, layers)
        print(f"{len(layers)} layers measured; partition {doc['partition']}")
    if args.out:
        text = json.dumps(doc, indent=2) + "\n"
        try:
            write_output(args.out, text, "-o")
        except InvalidInputError:
            print(text, end="")  # the measurements are not lost: the spec goes to stdout instead
            raise
        print(f"job spec written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m runtime_adapter.cli`."""
    from planner.cli import parse_args  # refuses `--X=--` as `recycle` does

    parser = argparse.ArgumentParser(prog="recycle-runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    add_worker_parser(sub)
    add_launch_parser(sub)
    add_store_parser(sub)
    add_profile_parser(sub)
    args = parse_args(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return int(args.func(args))
    except InvalidInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
