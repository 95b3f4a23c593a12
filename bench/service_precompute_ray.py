"""`python -m bench.service_precompute_ray`: a job's background precompute in the service, local vs Ray.

Registers one job (default gpt3-13b-p8d8, up to 1 failure) in the in-process service twice, with fresh
data directories: with the local background pool (`--processes` processes), then with
RECYCLE_RAY_ADDRESS set to a cluster of two node processes with one CPU each started here
(bench/precompute_ray_cluster.py; its start-up is timed apart). Prints the wall time from
registration until every key is stored (the service's start-up, Ray's connection included, is not
timed; the pools' and Ray's workers start within it), keys per second, how many stored plans have the same
iteration time on both paths, and /proc/loadavg (on a shared 2-core machine expect no speed-up: the
figure shows the dispatch overhead; on a real cluster the wall time divides by its CPUs).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from pydantic import SecretStr

from api.main import create_app
from api.settings import Settings
from api.solver import enumerate_scenarios
from bench.precompute import INSTANCE, loadavg
from planner.contract import JobSpec
from planner.normalize import normalize

CTL = {"Authorization": "Bearer bench"}


def _run(
    job: JobSpec, max_failures: int, data_dir: Path, args: argparse.Namespace
) -> tuple[float, dict[str, Any]]:
    """Seconds from registration until the precompute is done, and the stored plans' iteration times."""
    settings = Settings(
        data_dir=data_dir,
        controller_token=SecretStr("bench"),
        precompute_time_limit_s=args.time_limit,
        background_processes=args.processes,
    )
    keys = [normalize(job, sc).key for sc in enumerate_scenarios(job, max_failures, 2000)]
    with TestClient(create_app(settings)) as client:
        body = {"job": job.model_dump(mode="json", exclude_none=True), "max_failures": max_failures}
        t0 = time.perf_counter()
        r = client.post("/v1/jobs", json={**body, "heartbeat_enabled": False}, headers=CTL)
        assert r.status_code == 201, r.text
        url = f"/v1/jobs/{r.json()['id']}"
        while (p := client.get(url, headers=CTL).json()["precompute"])["done"] < p["total"] or not p["total"]:
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        store = client.app.state.service.store  # type: ignore[attr-defined]
        plans = {k: getattr(store.get_plan(k), "iteration_time_ms", None) for k in keys}
    return wall, plans


def main(argv: list[str] | None = None) -> int:
    from bench.precompute_ray_cluster import LocalRayCluster

    parser = argparse.ArgumentParser(prog="python -m bench.service_precompute_ray", description=__doc__)
    parser.add_argument("--instance", type=Path, default=INSTANCE, help="job spec (default gpt3-13b-p8d8)")
    parser.add_argument("--max-failures", type=int, default=1, help="precompute up to this many (default 1)")
    parser.add_argument("--time-limit", type=float, default=3.0, help="CP-SAT seconds per key (default 3)")
    parser.add_argument("--processes", type=int, default=2, help="local background processes (default 2)")
    args = parser.parse_args(argv)
    job = JobSpec.model_validate_json(args.instance.read_text())
    os.environ.pop("RECYCLE_RAY_ADDRESS", None)
    with tempfile.TemporaryDirectory(prefix="bench-svc-ray-") as tmp:
        print(f"loadavg before: {loadavg()}")
        local_s, local = _run(job, args.max_failures, Path(tmp) / "local", args)
        n = len(local)
        print(f"local, {args.processes} processes: {local_s:.1f} s, {n / local_s:.3f} keys/s ({n} keys)")
        print(f"loadavg between: {loadavg()}")
        t0 = time.perf_counter()
        with LocalRayCluster(nodes=2, cpus=1) as cluster:
            print(
                f"Ray cluster (2 nodes x 1 CPU) started in {time.perf_counter() - t0:.1f} s (not timed below)"
            )
            os.environ["RECYCLE_RAY_ADDRESS"] = cluster.address
            try:
                ray_s, on_ray = _run(job, args.max_failures, Path(tmp) / "ray", args)
            finally:
                os.environ.pop("RECYCLE_RAY_ADDRESS", None)
        print(f"Ray, 2 nodes x 1 CPU: {ray_s:.1f} s, {n / ray_s:.3f} keys/s")
        same = sum(1 for k in local if local[k] is not None and local[k] == on_ray.get(k))
        print(f"same iteration time on both paths: {same} of {n} keys")
        print(f"loadavg after: {loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
