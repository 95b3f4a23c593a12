"""Re-partition benchmark (issue 12): re-route only, Oobleck-style and re-route + re-partition.

    python -m bench.repartition [JOB.json ...] [--stages all|ends] [--out DIR]

For every instance (default: examples/gpt3-*.json) and failure set (every count 1..D-1 on one
stage, for every stage or, with `--stages ends`/`--max-sets`, a subset; plus bench.planner's spread
sets) it prints: re-route only (planner.plan on the job's partition, greedy), the Oobleck-style
model's iteration time (whatif.strategies.oobleck), the combined strategy (planner.partition,
greedy), the best load bound over all partitions, the combined plan's gap to it, the layers moved
and the migration estimate, and the planning time. Then a per-instance summary: is the combined
time <= min(re-route only, Oobleck-style) everywhere, and strictly better than both somewhere?
Writes results.json and results.md into --out, with /proc/loadavg beside the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from planner.cli_io import finite_float, read_document
from planner.contract import FailureScenario, JobSpec
from planner.outputs import render_table
from planner.partition.choose import plan_repartition
from planner.plan import plan
from whatif.strategies import Costs, Oobleck

TOLERANCE = 1e-6  # relative: "at most" with float noise


def failure_sets(
    job: JobSpec, stages: str, counts: list[int] | None = None
) -> list[tuple[str, list[tuple[int, int]]]]:
    """k = 1..D-1 failures on one stage (pipelines 0..k-1: every placement within a stage is the
    same up to pipeline permutation), for every stage or the first, middle and last; plus the
    spread sets of bench.planner."""
    from bench.planner import failure_cases

    D, P = job.num_pipelines, job.num_stages
    chosen = range(P) if stages == "all" else sorted({0, 1, P // 2, P - 1})
    ks = [k for k in counts or range(1, D) if 1 <= k < D]
    cases = [(f"{k} on stage {s}", [(d, s) for d in range(k)]) for s in chosen for k in ks]
    cases += [
        (label, failed) for label, failed in failure_cases(job, 3) if "spread" in label or "adjacent" in label
    ]
    return cases


def bench_set(
    job: JobSpec, oobleck: Oobleck, failed: list[tuple[int, int]], limit: timedelta
) -> dict[str, Any]:
    """One failure set's figures."""
    scenario = FailureScenario(failed=failed)
    rep = plan_repartition(job, scenario, time_limit=limit, use_cpsat=False)
    oob = oobleck.outcome(scenario).iteration_time_ms
    combined = rep.iteration_time_ms
    if rep.reroute is None:  # not needed by the choice (its bound is above); planned here for the table
        reroute = plan(job, scenario, time_limit=limit, use_cpsat=False).iteration_time_ms
    else:
        reroute = rep.reroute.iteration_time_ms
    best_other = min(reroute, oob if oob is not None else float("inf"))
    return {
        "job": job.name,
        "failed": [list(w) for w in failed],
        "reroute_only_ms": reroute,
        "oobleck_ms": oob,
        "combined_ms": combined,
        "best_load_bound_ms": rep.best_load_bound_ms,
        "gap_to_best_bound": combined / rep.best_load_bound_ms - 1,
        "combined_vs_best_other": combined / best_other - 1,
        "at_most_both": combined <= best_other * (1 + TOLERANCE),
        "better_than_both": combined < best_other * (1 - TOLERANCE),
        "partition": rep.partition,
        "repartitioned": rep.repartitioned,
        "layers_moved": sum(m.layers[1] - m.layers[0] for m in rep.migration.moves),
        "migration_mib": rep.migration.mib,
        "migration_ms": rep.migration.estimated_ms,
        "planning_s": rep.planning_s,
        "planning_cpu_s": rep.planning_cpu_s,
        "note": rep.note,
    }


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


def to_markdown(rows: list[dict[str, Any]]) -> str:
    headers = ["job", "failure set", "re-route only", "Oobleck-style", "combined", "best bound",
               "gap to bound", "vs best other", "moved", "migration", "plan s (cpu)"]  # fmt: skip
    body = [
        [
            r["job"],
            r["case"],
            f"{r['reroute_only_ms']:.1f}",
            "fatal" if r["oobleck_ms"] is None else f"{r['oobleck_ms']:.1f}",
            f"{r['combined_ms']:.1f}",
            f"{r['best_load_bound_ms']:.1f}",
            f"{r['gap_to_best_bound']:+.1%}",
            f"{r['combined_vs_best_other']:+.1%}",
            str(r["layers_moved"]),
            f"{r['migration_mib']:.0f} MiB / {r['migration_ms']:.0f} ms",
            f"{r['planning_s']:.1f} ({r['planning_cpu_s']:.1f})",
        ]
        for r in rows
    ]
    return render_table(headers, body, markdown=True)


def summary(rows: list[dict[str, Any]]) -> str:
    """Per instance: sets, how many at most min(re-route, Oobleck), strictly better, worst ratio,
    largest planning time."""
    lines = []
    for name in dict.fromkeys(r["job"] for r in rows):
        mine = [r for r in rows if r["job"] == name]
        misses = [r for r in mine if not r["at_most_both"]]
        lines.append(
            f"{name}: {len(mine)} sets; combined <= min(re-route only, Oobleck-style) on "
            f"{len(mine) - len(misses)}, strictly better than both on "
            f"{sum(r['better_than_both'] for r in mine)}; worst combined / best other "
            f"{max(r['combined_vs_best_other'] for r in mine):+.2%}; planning max "
            f"{max(r['planning_s'] for r in mine):.1f} s wall, "
            f"{max(r['planning_cpu_s'] for r in mine):.1f} s CPU"
            + (f"; misses: {', '.join(r['case'] for r in misses)}" if misses else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.repartition", description=__doc__.split("\n\n")[0])
    p.add_argument("instances", nargs="*", help="job specs (default: examples/gpt3-*.json)")
    p.add_argument("--stages", choices=("all", "ends"), default="all", help="every stage, or 0, 1, P/2, P-1")
    p.add_argument("--counts", help="failure counts on one stage, comma-separated (default 1..D-1)")
    p.add_argument("--time-limit", type=finite_float, default=3.0, help="greedy budget per plan, s")
    p.add_argument("--out", default="bench-results/repartition", help="directory for results.json/.md")
    args = p.parse_args(argv)
    paths = args.instances or sorted(str(x) for x in Path("examples").glob("gpt3-*.json"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    load_before = loadavg()
    for path in paths:
        job = read_document(path, JobSpec, "job spec")
        oobleck = Oobleck(job, Costs())
        counts = [int(k) for k in args.counts.split(",")] if args.counts else None
        for label, failed in failure_sets(job, args.stages, counts):
            row = {"case": label, **bench_set(job, oobleck, failed, timedelta(seconds=args.time_limit))}
            rows.append(row)
            oob = "fatal" if row["oobleck_ms"] is None else f"{row['oobleck_ms']:8.1f}"
            print(
                f"{job.name:22s} {label:16s} reroute {row['reroute_only_ms']:8.1f}  oobleck {oob}  "
                f"combined {row['combined_ms']:8.1f}  bound {row['best_load_bound_ms']:8.1f}  "
                f"{row['planning_s']:.1f}s ({row['planning_cpu_s']:.1f}s cpu)",
                flush=True,
            )
            payload = {"loadavg_before": load_before, "loadavg_now": loadavg(), "rows": rows}
            (out / "results.json").write_text(json.dumps(payload, indent=1))
    md, summ = to_markdown(rows), summary(rows)
    load = f"loadavg before: {load_before}; after: {loadavg()}"
    (out / "results.md").write_text(f"{load}\n\n{md}\n\n{summ}\n")
    print(md, summ, load, sep="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
