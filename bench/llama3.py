"""Llama 3's grid: plan time (wall and CPU) and ratios to both bounds for 0-3 failures, and the 54-day
simulate.

    python -m bench.llama3 [--job ../shared/instances/llama3-405b-p16d128.json] [--simulate]

Plans each failure case of bench.planner.failure_cases (greedy only, as `recycle simulate --exact`
and `recycle precompute` plan; the plan is made on the reduced grid of planner/reduced.py and the
full 2,048-worker schedule validated by the referee) and prints one row per case with the load
average beside it (the machine is shared). `--simulate` also times `recycle simulate JOB --duration
54d --seed 1` (default strategies, Llama 3's failure rate) in a fresh process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from bench.planner import failure_cases
from planner.contract import FailureScenario, JobSpec
from planner.plan import plan

DEFAULT_JOB = Path(__file__).resolve().parents[2] / "shared" / "instances" / "llama3-405b-p16d128.json"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def plan_rows(job: JobSpec, max_failures: int) -> list[dict[str, object]]:
    """One row per failure case: plan wall time, iteration time, both bounds and the ratios."""
    rows = []
    for label, failed in failure_cases(job, max_failures):
        t0, c0 = time.perf_counter(), time.process_time()
        result = plan(job, FailureScenario(failed=failed), use_cpsat=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        t = result.iteration_time_ms
        row = {
            "case": label,
            "failed": failed,
            "plan_s": wall,
            "plan_cpu_s": cpu,
            "iteration_time_ms": t,
            "lower_bound_ms": result.lower_bound_ms,
            "memory_bound_ms": result.memory_bound_ms,
            "ratio_to_load_bound": t / result.lower_bound_ms,
            "ratio_to_memory_bound": t / result.memory_bound_ms,
            "vs_1f1b": result.baseline_1f1b_ms / t,
            "source": result.source,
            "loadavg": loadavg(),
        }
        print(
            f"{label:12} {failed!s:28} plan {wall:5.1f} s ({cpu:4.1f} s CPU)  T {t:9.1f} ms"
            f"  /LB {t / result.lower_bound_ms:.4f}  /memLB {t / result.memory_bound_ms:.4f}"
            f"  vs 1F1B {row['vs_1f1b']:.3f}  ({result.source})"
            f"  load {row['loadavg']}",
            flush=True,
        )
        rows.append(row)
    return rows


def time_simulate(job_path: Path) -> float:
    """Wall seconds of `recycle simulate JOB --duration 54d --seed 1` in a fresh process."""
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "recycle_cli", "simulate", str(job_path), "--duration", "54d", "--seed", "1"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - t0
    print(f"simulate 54 d, default strategies: {wall:.1f} s wall  load {loadavg()}", flush=True)
    return wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llama3", description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=DEFAULT_JOB, help="job spec (default: Llama 3's grid)")
    parser.add_argument("--max-failures", type=int, default=3, help="failure counts 0..N (default 3)")
    parser.add_argument("--simulate", action="store_true", help="also time the 54-day simulate")
    args = parser.parse_args(argv)
    if not args.job.is_file():
        parser.error(f"--job: no such file {args.job}")
    job = JobSpec.model_validate_json(args.job.read_text())
    print(f"{job.name}: {job.num_pipelines} pipelines x {job.num_stages} stages, load {loadavg()}")
    plan_rows(job, args.max_failures)
    if args.simulate:
        time_simulate(args.job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
