"""`recycle`: plan, validate and benchmark fault-tolerant pipeline schedules from the shell.

Exit codes: 0 success; 2 bad input (unreadable file, malformed JSON, invalid field, bad flag);
3 unrecoverable failure set (a stage with no alive worker); 4 a schedule that breaks a rule.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path

from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import InvalidInputError, ScheduleRuleError, UnrecoverableScenarioError

EXIT_INPUT, EXIT_UNRECOVERABLE, EXIT_INVALID = 2, 3, 4


def _progress_printer() -> object:
    """A progress callback that stays quiet for the first second, then prints lines to stderr."""
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        elapsed = time.perf_counter() - t0
        if elapsed >= 1.0:
            print(f"[{elapsed:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return progress


def _pct(gap: float) -> str:
    """A gap as a percentage; the K=4 transient can put it a hair below zero, shown as 0."""
    return f"{0.0 if abs(gap) < 5e-6 else gap:.3%}"


def _summary(fig: dict, report: dict) -> str:
    from planner.outputs import render_key_values, render_table

    pairs: list[tuple[str, object]] = [
        ("job", fig["job"]),
        ("failed", fig["failed"] or "none"),
        ("iteration time (ms)", fig["iteration_time_ms"]),
    ]
    if "baseline_1f1b_ms" in fig:
        pairs += [
            ("failure-free 1F1B (ms)", fig["baseline_1f1b_ms"]),
            ("throughput retained", f"{fig['throughput_retained']:.2%}"),
        ]
    pairs += [
        ("load lower bound (ms)", report["lower_bound_ms"]),
        ("gap to load bound", _pct(report["gap"])),
    ]
    if "memory_bound_ms" in fig:
        pairs += [
            ("memory-aware bound (ms)", fig["memory_bound_ms"]),
            ("gap to memory-aware bound", _pct(fig["gap_to_memory_bound"])),
            ("planned by", fig["source"]),
            ("greedy (ms, s)", f"{fig['greedy_ms']:.3f} ms in {fig['greedy_s']:.2f} s"),
        ]
        cp = fig.get("cpsat") or {}
        if cp:
            detail = f"{cp.get('status')}"
            if cp.get("wall_s") is not None:
                detail += f" in {cp['wall_s']:.1f} s, proven bound {cp.get('cpsat_bound_ms') or 0:.3f} ms"
            pairs.append(("cp-sat", detail))
    pairs.append(("bubble ratio", f"{report['bubble_ratio']:.2%}"))
    rows = [
        [s, peak, cap if cap is not None else "unlimited"]
        for s, (peak, cap) in enumerate(
            zip(report["peak_memory_by_stage"], report["capacity_by_stage"], strict=True)
        )
    ]
    return render_key_values(pairs) + "\n\n" + render_table(["stage", "peak MiB", "capacity MiB"], rows)


def _write_outputs(args: argparse.Namespace, schedule: Schedule, job: JobSpec) -> None:
    if args.output:
        Path(args.output).write_text(schedule.model_dump_json(indent=1, exclude_none=True) + "\n")
    if args.gantt:
        from planner.outputs import write_gantt

        write_gantt(schedule, job, args.gantt)
    if args.trace:
        from planner.outputs import write_chrome_trace

        write_chrome_trace(schedule, job, args.trace)


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.cli_io import build_scenario, read_document
    from planner.plan import plan

    job = read_document(args.job, JobSpec, "job spec")
    scenario = build_scenario(args.scenario, args.fail, args.slow)
    if args.time_limit <= 0:
        raise InvalidInputError("--time-limit must be positive (seconds)")
    result = plan(
        job,
        scenario,
        time_limit=timedelta(seconds=args.time_limit),
        use_cpsat=not args.no_cpsat,
        progress=_progress_printer(),  # type: ignore[arg-type]
    )
    _write_outputs(args, result.schedule, job)
    fig = result.figures()
    if args.json:
        print(json.dumps(fig, indent=1))
    else:
        print(_summary(fig, fig["validation"]))  # type: ignore[arg-type]
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from planner.cli_io import read_document
    from planner.simulator import validate

    job = read_document(args.job, JobSpec, "job spec")
    schedule = read_document(args.schedule, Schedule, "schedule")
    if args.scenario:
        scenario = read_document(args.scenario, FailureScenario, "failure scenario")
    else:
        scenario = schedule.scenario()
    iterations = args.iterations or schedule.replay_iterations or 4
    if iterations < 4:
        raise InvalidInputError("--iterations must be at least 4 (CONTRACT.md section 4)")
    try:
        report = validate(job, scenario, schedule, num_iterations=iterations)
    except ScheduleRuleError as exc:
        if args.json:
            print(json.dumps({"valid": False, "rule": exc.rule, "error": str(exc)}))
        else:
            print(f"INVALID: {exc}")
        return EXIT_INVALID
    fig = {
        "job": schedule.job,
        "failed": [list(w) for w in schedule.failed],
        "iteration_time_ms": report.iteration_time_ms,
    }
    if args.json:
        print(json.dumps({"valid": True, **fig, "validation": report.to_dict()}, indent=1))
    else:
        print("VALID\n" + _summary(fig, report.to_dict()))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from bench.planner import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recycle", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a schedule for a job spec and a failure set")
    p.add_argument("job", help="job spec JSON (CONTRACT.md section 1)")
    p.add_argument("--fail", action="append", default=[], metavar="D,S", help="a failed worker (repeatable)")
    p.add_argument(
        "--slow", action="append", default=[], metavar="D,S:FACTOR", help="a slow worker (repeatable)"
    )
    p.add_argument("--scenario", help="failure scenario JSON (CONTRACT.md section 2); flags add to it")
    p.add_argument("-o", "--output", help="write the schedule JSON here")
    p.add_argument("--gantt", help="write a Gantt chart PNG here")
    p.add_argument("--trace", help="write a Chrome trace JSON (open in Perfetto) here")
    p.add_argument(
        "--time-limit",
        type=float,
        default=10.0,
        help="CP-SAT time limit in seconds (default 10); the greedy portfolio before it gets the same, "
        "or RECYCLE_GREEDY_BUDGET_S if smaller",
    )
    p.add_argument("--no-cpsat", action="store_true", help="greedy only, no CP-SAT refinement")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    p.set_defaults(func=cmd_plan)

    v = sub.add_parser("validate", help="replay a schedule and print its figures or the rule it breaks")
    v.add_argument("job", help="job spec JSON")
    v.add_argument("schedule", help="schedule JSON (CONTRACT.md section 3)")
    v.add_argument("--scenario", help="failure scenario JSON (default: the schedule's own failed/slow)")
    v.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="replayed iterations K (>= 4; default: the schedule's replay_iterations, else 4)",
    )
    v.add_argument("--json", action="store_true", help="print JSON")
    v.set_defaults(func=cmd_validate)

    b = sub.add_parser("bench", help="benchmark baselines and the adaptive planner over instances")
    b.add_argument("instances", nargs="*", help="job specs (default: examples/*.json)")
    b.add_argument("--out", default="bench-results", help="directory for results.json and results.md")
    b.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT time limit per case, seconds")
    b.add_argument("--max-failures", type=int, default=3, help="failure counts 0..N (default 3)")
    b.set_defaults(func=cmd_bench)

    from api.cli import add_serve_parser
    from runtime_adapter.cli import add_launch_parser, add_profile_parser, add_worker_parser
    from whatif.cli import add_whatif_parsers

    add_serve_parser(sub)
    add_worker_parser(sub)
    add_launch_parser(sub)
    add_profile_parser(sub)

    add_whatif_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except UnrecoverableScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNRECOVERABLE
    except InvalidInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except ScheduleRuleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
