"""`python -m bench.precompute`: `recycle precompute` in local processes vs on a 2-node local Ray cluster.

Plans the normalized scenarios of an instance (default gpt3-13b-p8d8, up to 2 failures) twice into
fresh directories: with `--workers` local processes, then as Ray tasks on a cluster of two node
processes with one CPU each started here (bench/precompute_ray_cluster.py; its start-up is timed
apart). Prints wall times, scenarios per second, the Ray path's extra seconds per scenario, whether
both made the same plans, and /proc/loadavg (on a shared 2-core machine expect no speed-up: the
figure is Ray's overhead; the seconds per scenario spent outside the tasks' own planning time are
the fairer measure when the machine's load changes between the two runs). `--limit N` plans only the
first N scenarios (k = 0, 1, 2 in order).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from planner.contract import JobSpec
from whatif.cache import PlanCache
from whatif.precompute import plan_missing
from whatif.scenarios import canonical_scenarios
from whatif.strategies.recycle import DEFAULT_PLAN_TIME_LIMIT

INSTANCE = Path(__file__).resolve().parents[2] / "shared" / "instances" / "gpt3-13b-p8d8.json"
FIGURES = ("unrecoverable", "iteration_time_ms", "lower_bound_ms", "memory_bound_ms")


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def _timed_run(job: JobSpec, scenarios: list, root: Path, workers: int, ray_address: str | None) -> float:
    t0 = time.perf_counter()
    _, planned, _ = plan_missing(
        job, scenarios, PlanCache(root), workers, False, DEFAULT_PLAN_TIME_LIMIT, False, ray_address
    )
    assert planned == len({c.key for c in scenarios})
    return time.perf_counter() - t0


def _figures(root: Path) -> dict[str, tuple[object, ...]]:
    cache = PlanCache(root)
    return {p.stem: tuple((cache.get(p.stem) or {}).get(f) for f in FIGURES) for p in root.glob("*.json")}


def _report(label: str, root: Path, wall_s: float, n: int, slots: int) -> None:
    """Wall time, rate, and the time per scenario that was not planning: wall x slots minus the
    planning seconds the tasks measured themselves (`plan_s`), over the scenarios."""
    cache = PlanCache(root)
    plan_s = sum(float((cache.get(p.stem) or {}).get("plan_s", 0.0)) for p in root.glob("*.json"))
    print(
        f"{label}: {wall_s:.1f} s, {n / wall_s:.3f} scenarios/s; planning {plan_s:.1f} s in tasks, "
        f"{(wall_s * slots - plan_s) / n:.2f} s per scenario outside planning ({slots} slots)"
    )


def main(argv: list[str] | None = None) -> int:
    from bench.precompute_ray_cluster import LocalRayCluster

    ap = argparse.ArgumentParser(prog="python -m bench.precompute", description=__doc__)
    ap.add_argument("--instance", type=Path, default=INSTANCE, help="job spec JSON (default gpt3-13b-p8d8)")
    ap.add_argument("--max-failures", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="plan only the first N scenarios (0: all)")
    ap.add_argument("--workers", type=int, default=2, help="local processes (the Ray cluster: 2 x 1 CPU)")
    args = ap.parse_args(argv)
    job = JobSpec.model_validate_json(args.instance.read_text())
    scenarios = [c for k in range(args.max_failures + 1) for c in canonical_scenarios(job, k)]
    total = len(scenarios)
    if args.limit:
        scenarios = scenarios[: args.limit]
    n = len(scenarios)
    print(f"{job.name}: {n} of {total} normalized scenarios up to {args.max_failures} failures")
    print(f"loadavg before: {loadavg()}")
    with tempfile.TemporaryDirectory(prefix="bench-precompute-") as tmp:
        local_s = _timed_run(job, scenarios, Path(tmp) / "local", args.workers, None)
        _report(f"local, {args.workers} processes", Path(tmp) / "local", local_s, n, args.workers)
        print(f"loadavg: {loadavg()}")
        t0 = time.perf_counter()
        with LocalRayCluster(nodes=2, cpus=1) as cluster:
            print(f"Ray cluster (2 nodes x 1 CPU) started in {time.perf_counter() - t0:.1f} s")
            import ray

            ray_s = _timed_run(job, scenarios, Path(tmp) / "ray", args.workers, cluster.address)
            ray.shutdown()
        _report("Ray, 2 nodes x 1 CPU (connect included)", Path(tmp) / "ray", ray_s, n, 2)
        print(f"Ray - local: {(ray_s - local_s) / n:+.2f} s per scenario ({ray_s / local_s:.2f}x local wall)")
        local, on_ray = _figures(Path(tmp) / "local"), _figures(Path(tmp) / "ray")
        same = sum(local[k] == on_ray.get(k) for k in local)
        print(f"same figures: {same} of {len(local)} plans")
        print(f"loadavg after: {loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
