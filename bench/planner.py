"""Planner benchmark: baselines against the adaptive planner over instances and failure sets.

    recycle bench [JOB.json ...] --out bench-results      (or: python -m bench.planner ...)

add_bench_parser(sub) is how the `recycle` dispatcher (recycle_cli) gets the subcommand; this module
imports the planner only, never the dispatcher.

For every instance and failure case it prints and records: failure-free 1F1B, naive re-route,
1F1B on the surviving pipelines, adaptive greedy, adaptive final (CP-SAT where it ran), the load
bound and the memory-aware bound, gaps, solve time (wall and this process's CPU, with the load
average: the machine may be shared) and peak memory. `--cases` runs a subset of the failure cases
(e.g. '3 adjacent'). Writes results.json and results.md (a markdown table) into --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path

from planner.baselines import baseline_schedule
from planner.cli_io import finite_float
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError, PlannerError, ScheduleRuleError
from planner.outputs import format_cell, render_table
from planner.plan import plan
from planner.simulator import validate

CASE_LABELS = ("none", "1", "2 spread", "2 one stage", "3 spread", "3 adjacent", "3 one stage")


def failure_cases(job: JobSpec, max_failures: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """Deterministic cases: none; one failure at the first, a middle and the last stage; two and
    three failures spread over stages and concentrated on one stage (where the grid allows)."""
    D, P = job.num_pipelines, job.num_stages
    cases: list[tuple[str, list[tuple[int, int]]]] = [("none", [])]
    if max_failures >= 1 and D >= 2:
        for s in sorted({0, P // 2, P - 1}):
            cases.append(("1", [(1, s)]))
    if max_failures >= 2 and D >= 3:
        a, b = P // 4, (5 * P) // 8
        cases.append(("2 spread", [(1, a), (2, b)] if a != b else [(1, 0), (2, P - 1)]))
        cases.append(("2 one stage", [(1, a), (2, a)]))
    if max_failures >= 3 and D >= 4 and P >= 3:
        cases.append(("3 spread", [(0, 1 % P), (1, P // 2), (2, P - 1)]))
        cases.append(("3 adjacent", [(0, 1 % P), (1, 2 % P), (2, 3 % P)]))
        cases.append(("3 one stage", [(0, P // 2), (1, P // 2), (2, P // 2)]))
    seen, unique = set(), []
    for label, failed in cases:
        key = tuple(sorted(failed))
        if key not in seen:
            seen.add(key)
            unique.append((label, failed))
    return unique


def _baseline_ms(name: str, job: JobSpec, scenario: FailureScenario) -> float | str | None:
    """The baseline's iteration time; as a string ending in '*' when it breaks the memory capacity
    (baselines do not plan around memory), None when it does not apply to the scenario."""
    try:
        schedule = baseline_schedule(name, job, scenario)
    except (InvalidInputError, PlannerError):
        return None
    try:
        validate(job, scenario, schedule)
    except ScheduleRuleError as exc:
        if exc.rule == "memory":
            return f"{schedule.iteration_time_ms:.3f}*"
        raise
    return schedule.iteration_time_ms


def bench_case(job: JobSpec, failed: list[tuple[int, int]], time_limit: timedelta) -> dict[str, object]:
    """All figures of one (instance, failure set) case."""
    scenario = FailureScenario(failed=failed)
    t0, c0 = time.perf_counter(), time.process_time()
    result = plan(job, scenario, time_limit=time_limit)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rep = result.report
    return {
        "job": job.name,
        "failed": [list(w) for w in failed],
        "1f1b_failure_free_ms": result.baseline_1f1b_ms,
        "naive_reroute_ms": _baseline_ms("naive-reroute", job, scenario),
        "1f1b_survivors_ms": _baseline_ms("1f1b-survivors", job, scenario) if failed else None,
        "greedy_ms": result.greedy_ms,
        "adaptive_ms": result.iteration_time_ms,
        "source": result.source,
        "cpsat_status": (result.cpsat or {}).get("status"),
        "cpsat_bound_ms": (result.cpsat or {}).get("cpsat_bound_ms"),
        "lower_bound_ms": result.lower_bound_ms,
        "memory_bound_ms": result.memory_bound_ms,
        "ratio_to_load_bound": result.iteration_time_ms / result.lower_bound_ms,
        "ratio_to_memory_bound": result.iteration_time_ms / result.memory_bound_ms,
        "greedy_s": result.greedy_s,
        "plan_s": wall,
        "plan_cpu_s": cpu,  # this process's CPU time: on a shared machine the wall time is not the cost
        "loadavg_1min": _loadavg(),
        "peak_memory_mib": max(rep.peak_memory_by_stage),
        "capacity_mib": job.capacity_mib(0),
    }


def _loadavg() -> float | None:
    """The 1-minute load average when the case finished (None where /proc is absent)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _fmt(v: object) -> object:
    return "-" if v is None else v


def to_markdown(rows: list[dict[str, object]]) -> str:
    headers = [
        "instance",
        "failed",
        "1F1B ff",
        "naive",
        "survivors",
        "greedy",
        "adaptive",
        "load LB",
        "/LB",
        "mem LB",
        "/memLB",
        "by",
        "plan s",
        "cpu s",
        "load",
        "peak MiB",
    ]
    body = [
        [
            r["job"],
            " ".join(f"[{d},{s}]" for d, s in r["failed"]) or "none",  # type: ignore[attr-defined]
            r["1f1b_failure_free_ms"],
            _fmt(r["naive_reroute_ms"]),
            _fmt(r["1f1b_survivors_ms"]),
            r["greedy_ms"],
            r["adaptive_ms"],
            r["lower_bound_ms"],
            f"{r['ratio_to_load_bound']:.4f}",
            r["memory_bound_ms"],
            f"{r['ratio_to_memory_bound']:.4f}",
            f"{r['source']} ({r['cpsat_status']})" if r["cpsat_status"] else r["source"],
            f"{r['plan_s']:.2f}",
            f"{r['plan_cpu_s']:.2f}" if "plan_cpu_s" in r else "-",
            "-" if r.get("loadavg_1min") is None else f"{r['loadavg_1min']:.1f}",
            r["peak_memory_mib"],
        ]
        for r in rows
    ]
    return render_table(headers, body, markdown=True)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; prints one line per case as it goes and the table at the end."""
    paths = args.instances or sorted(str(p) for p in Path("examples").glob("*.json"))
    if not paths:
        raise InvalidInputError("no instances given and none found in examples/")
    from planner.cli_io import check_output_dir, read_document

    jobs = [read_document(path, JobSpec, "job spec") for path in paths]  # every input read before any output
    check_output_dir(args.out, "--out")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, object]] = []
    for job in jobs:
        for label, failed in failure_cases(job, args.max_failures):
            if args.cases and label not in args.cases:
                continue
            row = bench_case(job, failed, timedelta(seconds=args.time_limit))
            row["case"] = label
            rows.append(row)
            print(
                f"{job.name:24s} {label:12s} {row['failed']!s:28s} adaptive {row['adaptive_ms']:9.3f} ms"
                f"  /LB {row['ratio_to_load_bound']:.4f}  /memLB {row['ratio_to_memory_bound']:.4f}"
                f"  naive {format_cell(row['naive_reroute_ms'])}  {row['plan_s']:.2f}s"
                f" (cpu {row['plan_cpu_s']:.2f}s, load {_fmt(row['loadavg_1min'])})",
                flush=True,
            )
            (out / "results.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    md = to_markdown(rows)
    note = "`*`: the baseline's schedule exceeds the memory capacity (baselines do not plan around it)."
    (out / "results.md").write_text(f"Machine: {machine()}\n\n{md}\n\n{note}\n")
    print(md)
    return 0


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def cmd_bench(args: argparse.Namespace) -> int:
    return run_bench(args)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle bench`."""
    b = sub.add_parser("bench", help="benchmark baselines and the adaptive planner over instances")
    b.add_argument("instances", nargs="*", help="job specs (default: examples/*.json)")
    b.add_argument("--out", default="bench-results", help="directory for results.json and results.md")
    b.add_argument(
        "--time-limit", type=finite_float, default=10.0, help="CP-SAT time limit per case, seconds"
    )
    b.add_argument("--max-failures", type=int, default=3, help="failure counts 0..N (default 3)")
    b.add_argument(
        "--cases",
        nargs="+",
        choices=CASE_LABELS,
        help="only these failure cases (e.g. --cases '3 adjacent'); default: all",
    )
    b.set_defaults(func=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.planner ARGS` = `recycle bench ARGS` (same usage, errors and exit codes)."""
    from planner.cli import run

    parser = argparse.ArgumentParser(prog="recycle")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser, ["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
