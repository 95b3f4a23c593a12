"""Where a plan's busiest workers idle, against the terms of the bounds (issue 13).

    python -m bench.idle_breakdown JOB.json [--failed D,S ...] [--time-limit S] [--no-cpsat] [--trace]

Plans the scenario (`plan()`), replays its orders for 12 iterations (bench/idle_trace.py
`replay_last`) with the referee's clock and splits, in the last one, each stage's busiest worker's
period into: its load (F+B+W), the all-reduce and OPT (the load bound's terms), and idle by where it
falls: before its first op (waiting for its first F: the stage's iteration started before the F
reached it), between its first op and its first B (the memory-aware bound's warm-up idle, at most),
in the middle, and before its OPT beyond the all-reduce (waiting for a peer's last W). One line per
stage. `--trace` then walks each middle gap of the bottleneck worker (the busiest worker of the
stage whose load, all-reduce, OPT and warm-up bound are the largest, or of `--stage`) back along its
critical path (bench/idle_trace.py): which stage's op queued behind which op, and how long.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

from pydantic import ValidationError

from bench.idle_trace import replay_last, summary, trace_gaps
from planner.bounds import warmup_idle_ms
from planner.cli_io import describe_validation_error, finite_float, parse_worker, read_document
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import InvalidInputError
from planner.plan import plan

COLUMNS = (
    "stage",
    "worker",
    "n",
    "period",
    "load",
    "ar+opt",
    "first F",
    "first B",
    "middle",
    "at OPT",
    "warm-up LB",
)


def breakdown(job: JobSpec, scenario: FailureScenario, schedule: Schedule) -> list[dict[str, float]]:
    """Per stage, the busiest worker's period split as the module doc says (last replayed iteration)."""
    lay, graph, start, end, prev_free = replay_last(job, scenario, schedule)
    rows = []
    actions = {(ws.worker[0], ws.worker[1]): ws.actions for ws in schedule.workers}
    for s in range(job.num_stages):
        i, w = max(
            ((i, w) for i, w in enumerate(lay.workers) if w[1] == s),
            key=lambda iw: sum(graph.duration[lay.first[iw[0]] : lay.first[iw[0] + 1]]),
        )
        a, b = lay.first[i], lay.first[i + 1]
        ops = [act.op for act in actions[w]]
        top = sum(1 for op in ops if op == "F")
        gaps = [start[a] - prev_free[i]] + [start[j] - end[j - 1] for j in range(a + 1, b)]
        first_b = next(k for k, op in enumerate(ops) if op in ("B", "BW"))
        ar = job.allreduce_ms(s)
        opt = graph.duration[b - 1]
        load = sum(graph.duration[a : b - 1])
        rows.append(
            {
                "stage": s,
                "worker": w[0],
                "n": top,
                "period": end[b - 1] - prev_free[i],
                "load": load,
                "ar+opt": ar + opt,
                "first F": gaps[0],
                "first B": sum(gaps[1 : first_b + 1]),
                "middle": sum(gaps[first_b + 1 : -1]),
                "at OPT": max(0.0, gaps[-1] - ar),
                "warm-up LB": warmup_idle_ms(job, scenario, s, scenario.slow_factor(w), top),
            }
        )
    return rows


def _bound_terms(row: dict[str, float]) -> float:
    return row["load"] + row["ar+opt"] + row["warm-up LB"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.idle_breakdown", description=__doc__.split("\n")[0])
    ap.add_argument("job", help="job spec JSON")
    ap.add_argument("--failed", nargs="*", default=[], help="failed workers as D,S (e.g. 0,1 1,2 2,3)")
    ap.add_argument("--time-limit", type=finite_float, default=10.0, help="plan() time limit, seconds")
    ap.add_argument(
        "--no-cpsat", action="store_true", help="plan without CP-SAT (the greedy portfolio's plan)"
    )
    ap.add_argument("--trace", action="store_true", help="trace the middle gaps (bench/idle_trace.py)")
    ap.add_argument("--stage", type=int, default=None, help="with --trace: trace this stage's busiest worker")
    args = ap.parse_args(argv)
    if args.stage is not None and not args.trace:
        ap.error("--stage: only with --trace")
    try:
        failed = [parse_worker(entry, "--failed") for entry in args.failed]
    except InvalidInputError as exc:
        ap.error(str(exc))
    try:
        job = read_document(args.job, JobSpec, "job spec")
        if args.stage is not None and not 0 <= args.stage < job.num_stages:
            raise InvalidInputError(f"--stage {args.stage}: the job has stages 0..{job.num_stages - 1}")
        scenario = FailureScenario(failed=failed)
        limit = timedelta(seconds=args.time_limit)
        result = plan(job, scenario, time_limit=limit, use_cpsat=not args.no_cpsat)
    except InvalidInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"error: --failed:\n{describe_validation_error(exc)}", file=sys.stderr)
        return 2
    print(
        f"{job.name} {failed}: {result.iteration_time_ms:.3f} ms, load bound {result.lower_bound_ms:.3f}, "
        f"memory-aware {result.memory_bound_ms:.3f}, by {result.source}"
    )
    print(" ".join(f"{c:>10s}" for c in COLUMNS))
    rows = breakdown(job, scenario, result.schedule)
    for row in rows:
        print(" ".join(f"{row[c]:10.2f}" if isinstance(row[c], float) else f"{row[c]:10d}" for c in COLUMNS))
    if args.trace:
        row = rows[args.stage] if args.stage is not None else max(rows, key=_bound_terms)
        worker = (int(row["worker"]), int(row["stage"]))
        print(f"middle gaps of worker {list(worker)}, each walked back along its critical path:")
        print("\n".join(summary(trace_gaps(job, scenario, result.schedule, worker))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
