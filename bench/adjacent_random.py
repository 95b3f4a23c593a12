"""Adjacent-failure sets on random jobs no table lists (issue 13): how far `plan()` lands from the bounds.

    python -m bench.adjacent_random [--cases 20] [--seed 0] [--chain 3] [--out FILE.json]

Each case draws a GPT-like job (D 4-8 pipelines, P 6-10 stages, M 2D-4D micro-batches, per-stage
F/B/W times within +-10% of a base, hops, all-reduce, memory for 2P activations or unbounded) and a
chain of `--chain` adjacent stages, each losing one worker of a different pipeline, at a random
position. It prints, per case, the default greedy policy alone on the balanced host map and
`plan()` (greedy portfolio with the look-ahead policies, no CP-SAT), as ratios to the load bound
and the memory-aware bound, with plan wall and CPU time; then the worst and the median.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

from planner.adaptive.greedy import GreedyOptions, run_greedy
from planner.bounds import load_bound, memory_bound
from planner.contract import FailureScenario, JobSpec
from planner.orders import to_schedule
from planner.plan import plan
from planner.problem import Problem


def random_case(rng: random.Random, chain: int) -> tuple[JobSpec, FailureScenario]:
    """One random job and an adjacent failure chain (distinct pipelines, consecutive stages)."""
    D, P = rng.randint(max(4, chain + 1), 8), rng.randint(max(6, chain), 10)
    M = rng.randint(2 * D, 4 * D)
    base = rng.uniform(4.0, 8.0)

    def jitter() -> float:
        return round(base * rng.uniform(0.9, 1.1), 3)

    stages = []
    for _ in range(P):
        f = jitter()
        stages.append(
            {
                "forward": f,
                "backward_input": f,
                "backward_weight": round(0.9 * f, 3),
                "optimizer": round(0.3 * base, 3),
                "activation_mib": 900.0,
                "weight_grad_mib": 300.0,
            }
        )
    hop = round(0.015 * base, 4)
    job = JobSpec.model_validate(
        {
            "name": f"rand-d{D}p{P}m{M}",
            "num_pipelines": D,
            "num_stages": P,
            "num_microbatches": M,
            "stages": stages,
            "comm": {"activation_ms": hop, "cross_pipeline_ms": 2 * hop, "allreduce_ms": round(base, 3)},
            "memory_capacity_mib": rng.choice([None, 900.0 * 2 * P]),
        }
    )
    first = rng.randint(0, P - chain)
    pipes = rng.sample(range(D), chain)
    return job, FailureScenario(failed=[(pipes[i], first + i) for i in range(chain)])


def default_policy_ms(job: JobSpec, scenario: FailureScenario) -> float:
    """The default greedy policy alone on the balanced host map (what the planner had before)."""
    problem = Problem.build(job, scenario)
    run = run_greedy(problem, GreedyOptions(num_iterations=6))
    return min(to_schedule(problem, o, "x").iteration_time_ms for o in run.orders_by_iteration[-3:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.adjacent_random", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=20, help="random cases (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    ap.add_argument("--chain", type=int, default=3, help="adjacent failed stages (default 3)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.cases < 1 or not 1 <= args.chain <= 4:
        ap.error("--cases must be >= 1 and --chain within 1..4")
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.cases):
        job, scenario = random_case(rng, args.chain)
        lb, mb = load_bound(job, scenario), memory_bound(job, scenario)
        before = default_policy_ms(job, scenario)
        t0, c0 = time.perf_counter(), time.process_time()
        result = plan(job, scenario, time_limit=timedelta(seconds=10), use_cpsat=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        row = {
            "job": job.name,
            "capacity_mib": job.memory_capacity_mib,
            "failed": [list(w) for w in scenario.failed],
            "default_over_lb": before / lb,
            "plan_over_lb": result.iteration_time_ms / lb,
            "plan_over_mb": result.iteration_time_ms / mb,
            "source": result.source,
            "plan_s": wall,
            "plan_cpu_s": cpu,
        }
        rows.append(row)
        print(
            f"{i:3d} {job.name:16s} cap {job.memory_capacity_mib!s:8s} {row['failed']!s:26s} default "
            f"{row['default_over_lb']:.4f}  plan /LB {row['plan_over_lb']:.4f}"
            f" /memLB {row['plan_over_mb']:.4f}"
            f"  {result.source:14s} {wall:.1f}s (cpu {cpu:.1f}s)",
            flush=True,
        )
    ratios = [float(r["plan_over_lb"]) for r in rows]  # type: ignore[arg-type]
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "-"
    print(f"plan/LB: worst {max(ratios):.4f}, median {statistics.median(ratios):.4f}; loadavg {load}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
