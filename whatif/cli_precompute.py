"""`recycle precompute JOB --max-failures K -o DIR`: parser and command (registered by whatif/cli.py)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from datetime import timedelta
from types import FrameType
from typing import Any

from planner.cli_io import finite_float
from planner.contract import JobSpec
from planner.errors import InvalidInputError
from whatif.cache import PlanCache


def add_precompute_parser(sub: Any) -> None:
    """`recycle precompute JOB --max-failures K -o DIR`."""
    p = sub.add_parser("precompute", help="plan every normalized scenario up to k failures into a cache")
    p.add_argument("job", help="job spec JSON (docs/contract.md section 1)")
    p.add_argument(
        "--max-failures",
        type=int,
        default=2,
        help="plan every scenario with 0, 1, ..., K failed workers (default 2; the number of failure "
        "sets grows like (D*P)^K, so 3 can take long on large grids)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="plan directory (created if missing); `recycle launch --schedules DIR` runs from it",
    )
    p.add_argument("--workers", type=int, default=2, help="planning processes (default 2; not with --ray)")
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="plan as tasks on this Ray cluster instead (auto, HOST:PORT or ray://HOST:PORT; default "
        'RECYCLE_RAY_ADDRESS; "" forces local processes); needs `pip install recycle[ray]` here and '
        "recycle installed on every node",
    )
    p.add_argument(
        "--time-limit", type=finite_float, default=3.0, help="greedy (and CP-SAT) budget per plan, s"
    )
    p.add_argument("--cpsat", action="store_true", help="also refine with CP-SAT (slow; default greedy only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_precompute)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def cmd_precompute(args: argparse.Namespace) -> int:
    """Plan what is missing; report normalization savings and what was (not) solved."""
    from planner.cli_io import check_output_dir, read_document
    from planner.settings import planner_settings
    from whatif.precompute import precompute

    check_output_dir(args.output, "-o/--output")
    job = read_document(args.job, JobSpec, "job spec")
    if args.max_failures < 0 or args.workers < 1 or args.time_limit <= 0:
        raise InvalidInputError("--max-failures >= 0, --workers >= 1 and --time-limit > 0 required")
    if args.max_failures > job.num_pipelines * job.num_stages:
        raise InvalidInputError(
            f"--max-failures {args.max_failures}: the job has {job.num_pipelines * job.num_stages} workers"
        )
    ray_address = args.ray if args.ray is not None else planner_settings().ray_address
    if ray_address:  # before anything is written: an unreachable cluster leaves the directory as it was
        from whatif.precompute_ray import connect

        connect(ray_address)
    from whatif.precompute import PlanningProcessDied
    from whatif.precompute_ray import ScenariosFailed

    previous = signal.signal(signal.SIGTERM, _interrupt)  # Slurm, Kubernetes, timeout: like Ctrl+C
    try:
        stats = precompute(
            job,
            args.max_failures,
            PlanCache(args.output),
            num_workers=args.workers,
            use_cpsat=args.cpsat,
            time_limit=timedelta(seconds=args.time_limit),
            progress=not args.no_progress,
            ray_address=ray_address or None,
        )
    except (ScenariosFailed, PlanningProcessDied) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # every finished plan is written; the index only comes with the last one
        print(
            f"\ninterrupted: the plans written so far stay in {args.output}; run again to resume",
            file=sys.stderr,
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    saved = stats.saved_by_normalization / max(1, stats.physical_scenarios)
    if args.json:
        print(json.dumps(stats.to_dict(), indent=1))
    else:
        print(
            f"{job.name}: {stats.physical_scenarios} failure sets up to {args.max_failures} failures -> "
            f"{stats.canonical_scenarios} normalized scenarios (normalization saved "
            f"{stats.saved_by_normalization}, {saved:.1%}); "
            f"{stats.already_cached} already cached, {stats.planned} planned now "
            f"({stats.unrecoverable} unrecoverable) in {stats.wall_s:.1f} s"
            f"{f' on Ray {ray_address}' if ray_address else ''} -> {args.output}"
        )
    return 0
