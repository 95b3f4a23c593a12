"""The exact single-worker relaxation against the closed-form memory-aware bound (issue 13).

    python -m bench.single_worker JOB.json [JOB.json ...] [--max-failures 3] [--max-labels N]

For each of `bench.planner`'s failure cases: the load bound, `memory_bound` (closed form) and
`single_worker_bound_ms` (planner/bounds_single.py: each stage's busiest worker alone, with the
round trip at its fastest and its memory capacity, solved exactly), their ratio and the seconds the
exact search took. Where the two bounds are equal, no order of the bottleneck worker's own ops
beats the closed form: a plan above it loses its time to other workers, not to its own order.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.planner import failure_cases
from planner.bounds import load_bound, memory_bound
from planner.bounds_single import single_worker_bound_ms
from planner.cli_io import read_document
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError

COLUMNS = ("instance", "failed", "load LB", "mem LB", "single-worker", "/memLB", "s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.single_worker", description=__doc__.split("\n")[0])
    ap.add_argument("jobs", nargs="+", help="job spec JSON files")
    ap.add_argument("--max-failures", type=int, default=3, help="failure cases up to this many failures")
    ap.add_argument("--max-labels", type=int, default=2_000_000, help="stop a search above this many labels")
    args = ap.parse_args(argv)
    if args.max_failures < 0:
        ap.error(f"--max-failures {args.max_failures}: at least 0")
    if args.max_labels < 1:
        ap.error(f"--max-labels {args.max_labels}: at least 1")
    try:
        jobs = [read_document(path, JobSpec, "job spec") for path in args.jobs]
    except InvalidInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("| " + " | ".join(COLUMNS) + " |")
    print("| " + " | ".join("---" for _ in COLUMNS) + " |")
    for job in jobs:
        for _, failed in failure_cases(job, args.max_failures):
            scenario = FailureScenario(failed=failed)
            t0 = time.perf_counter()
            exact = single_worker_bound_ms(job, scenario, args.max_labels)
            took = time.perf_counter() - t0
            mb = memory_bound(job, scenario)
            if exact is None:
                shown, ratio = "stopped", "-"
            elif exact == 0.0:  # no stage with identical peers has a memory capacity
                shown, ratio = "n/a", "-"
            else:
                shown, ratio = f"{exact:.3f}", f"{exact / mb:.4f}"
            failed_s = " ".join(f"[{d},{s}]" for d, s in failed) or "none"
            row = (
                job.name,
                failed_s,
                f"{load_bound(job, scenario):.3f}",
                f"{mb:.3f}",
                shown,
                ratio,
                f"{took:.1f}",
            )
            print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
