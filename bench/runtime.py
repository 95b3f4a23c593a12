"""Runtime benchmark (CPU, gloo, real processes on this machine).

    python -m bench.runtime [--out docs/bench/runtime.json] [--rounds 3] [--iterations 12] [--kills 3]

1. executor vs torch.distributed.pipelining's Schedule1F1B, failure-free, D=1, P=2, same model, M,
   optimizer and data; the two alternate `rounds` times; per-iteration medians and their ratio, plus a
   parameter check against each other.
2. plan fidelity: profile -> job spec (D=2, P=2) -> plan the failure of [1, 1] -> run it with [1, 1]
   absent from the start -> measured steady-state iteration time vs the planner's prediction. The
   3 alive workers share 2 cores: [0, 1] hosts all 16 micro-batches of stage 1 and is busy almost
   always, [0, 0] and [1, 0] about half the time, so about 2 processes compute at once. The profile
   is therefore taken in 2 concurrent processes ("x2", the comparable condition); "alone" (1) and
   "x3" (3, every worker always busy) are shown as the optimistic and pessimistic bounds.
3. recovery: kill -9 of [1, 1] in a running D=2, P=2 job (warm standby re-joins between kills): time
   from the launcher noticing the death to every survivor logging "running v<new> from iteration".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch

from bench.runtime_torch import run_torch
from planner.baselines import baseline_schedule
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.plan import plan
from planner.simulator import validate
from runtime_adapter.assignment import Worker
from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.model import GPTConfig, gpt_training
from runtime_adapter.profile import StageMeasurement, profile_stages
from runtime_adapter.profile_comm import job_spec_from_profile, measure_comm
from runtime_adapter.reference import relative_error

CFG = GPTConfig(vocab_size=256, hidden=256, num_heads=4, num_layers=4, seq_len=64, microbatch_size=1)
HOP = (CFG.microbatch_size, CFG.seq_len, CFG.hidden)  # one activation between stages
VICTIM: Worker = (1, 1)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def profile_concurrently(num_procs: int, D: int, M: int, repeats: int) -> list[StageMeasurement]:
    """Profile the stages in `num_procs` processes at once (the CPU sharing of a job with that many
    busy workers on this machine); per stage and field, the median over the processes."""
    out = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "bench.runtime", "_profile", "--pipelines", str(D), "--microbatches", str(M)]
    cmd += ["--repeats", str(repeats)]
    procs = [subprocess.Popen([*cmd, "--out", str(out / f"p{i}.json")], env=env) for i in range(num_procs)]
    if any(p.wait(timeout=600) != 0 for p in procs):
        raise RuntimeError(f"concurrent profiling failed ({out})")
    runs = [json.loads((out / f"p{i}.json").read_text()) for i in range(num_procs)]
    merged = []
    for s in range(len(runs[0])):
        fields = {k: statistics.median(r[s][k] for r in runs) for k in runs[0][s]}
        merged.append(StageMeasurement(**{**fields, "stage": s, "num_params": runs[0][s]["num_params"]}))
    return merged


def steady_ms(out: Path, workers: list[Worker], warmup: int) -> dict[str, float]:
    """Per worker: median `wall_ms` of its step records after `warmup` iterations."""
    res = {}
    for d, s in workers:
        lines = (out / f"acct_{d}_{s}.jsonl").read_text().splitlines()
        walls = [r["wall_ms"] for r in map(json.loads, lines) if r["event"] == "step" and r["it"] >= warmup]
        res[f"{d},{s}"] = statistics.median(walls)
    return res


@dataclass
class AliveSpec(LaunchSpec):
    """A LaunchSpec whose job starts with `absent` workers already gone: the launcher spawns only the
    others (with a schedule_for that always answers the schedule of that failure set)."""

    absent: frozenset[Worker] = frozenset()

    def workers(self) -> list[Worker]:
        """The alive workers only."""
        return [w for w in super().workers() if w not in self.absent]


def run_ours(
    job: JobSpec,
    schedule: Schedule,
    iterations: int,
    warmup: int,
    failed: set[Worker],
    options: dict[str, Any] | None = None,
) -> dict:
    """One run of our executor on the bench model (`options`: more entry kwargs, e.g. exact_sums)."""
    out = Path(tempfile.mkdtemp(prefix="bench-ours-"))
    model = {**asdict(CFG), **(options or {})}
    launcher = Launcher(AliveSpec(job, model, iterations, out, absent=frozenset(failed)), lambda _f: schedule)
    launcher.start()
    codes = launcher.wait(timedelta(seconds=600))
    alive = launcher.spec.workers()
    if any(codes[w] != 0 for w in alive):
        raise RuntimeError(f"our job failed: {codes} (logs in {out})")
    per_worker = steady_ms(out, alive, warmup)
    return {"out": str(out), "per_worker_ms": per_worker, "iteration_ms": max(per_worker.values())}


def bench_vs_torch(job1: JobSpec, rounds: int, iterations: int, warmup: int) -> dict:
    """Alternate our executor (planner 1F1B schedule) and Schedule1F1B; medians and their ratio."""
    schedule = baseline_schedule("1f1b", job1, FailureScenario())
    ours, theirs, check = [], [], None
    for r in range(rounds):
        order = ["torch", "ours"] if r % 2 == 0 else ["ours", "torch"]
        for who in order:
            if who == "torch":
                res = run_torch(CFG, job1.num_microbatches, iterations, warmup)
                theirs.append(res)
            else:
                res = run_ours(job1, schedule, iterations, warmup, set())
                ours.append(res)
            say(
                f"round {r + 1}/{rounds} {who}: {res['iteration_ms']:.1f} ms/iteration {res['per_worker_ms']}"
            )
        if check is None:  # same model, data and optimizer: parameters must agree
            check = max(
                relative_error(
                    torch.load(Path(ours[-1]["out"]) / f"final_0_{s}.pt"),
                    torch.load(Path(theirs[-1]["out"]) / f"torch_{s}.pt"),
                )
                for s in range(2)
            )
    ours_ms = statistics.median(r["iteration_ms"] for r in ours)
    torch_ms = statistics.median(r["iteration_ms"] for r in theirs)
    pairs = [o["iteration_ms"] / t["iteration_ms"] for o, t in zip(ours, theirs, strict=True)]
    return {
        "round_ratios": pairs,
        "median_round_ratio": statistics.median(pairs),
        "ours_ms": [r["iteration_ms"] for r in ours],
        "torch_ms": [r["iteration_ms"] for r in theirs],
        "ours_median_ms": ours_ms,
        "torch_median_ms": torch_ms,
        "ratio": ours_ms / torch_ms,
        "params_relative_error": check,
        "ours_op_ms": _op_breakdown(Path(ours[-1]["out"]), warmup),
        "predicted_1f1b_ms": schedule.iteration_time_ms,
    }


def _op_breakdown(out: Path, warmup: int) -> dict[str, dict[str, float]]:
    """Median per-iteration time per instruction kind of each worker (where the executor's time goes)."""
    res = {}
    for path in sorted(out.glob("acct_*.jsonl")):
        recs = [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "step"]
        recs = [r for r in recs if r["it"] >= warmup]
        kinds = recs[0]["op_ms"].keys()
        res[path.stem[5:]] = {k: round(statistics.median(r["op_ms"][k] for r in recs), 2) for k in kinds}
    return res


# -- plan fidelity and recovery ---------------------------------------------------------------------


def bench_fidelity(job2: JobSpec, iterations: int, warmup: int) -> dict:
    """Plan the failure of VICTIM from the profiled spec and run it with VICTIM absent."""
    result = plan(job2, FailureScenario(failed=[VICTIM]), time_limit=timedelta(seconds=10))
    run = run_ours(job2, result.schedule, iterations, warmup, {VICTIM})
    say(f"fidelity: predicted {result.iteration_time_ms:.1f} ms, measured {run['iteration_ms']:.1f} ms")
    as_run = _as_run_job(job2, result.schedule, Path(run["out"]), warmup)
    replayed = validate(
        as_run, FailureScenario(failed=[VICTIM]), result.schedule, check_claim=False
    ).iteration_time_ms
    return {
        "replayed_with_run_op_ms": replayed,
        "ratio_to_replay": run["iteration_ms"] / replayed,
        "as_run_stages": [json.loads(st.model_dump_json()) for st in as_run.stages],
        "failed": [list(VICTIM)],
        "predicted_ms": result.iteration_time_ms,
        "measured_ms": run["iteration_ms"],
        "measured_per_worker_ms": run["per_worker_ms"],
        "ratio": run["iteration_ms"] / result.iteration_time_ms,
        "plan_source": result.source,
        "op_ms": _op_breakdown(Path(run["out"]), warmup),
    }


def _as_run_job(job: JobSpec, schedule: Schedule, out: Path, warmup: int) -> JobSpec:
    """`job` with F, B and W replaced by what they took in the run (per stage: the mean over its alive
    workers of op_ms / ops per iteration, median over iterations): separates the replay model's
    error from the profile's (other load on a shared machine changes op times by the minute)."""
    per_stage: dict[int, dict[str, list[float]]] = {}
    for ws in schedule.workers:
        d, s = ws.worker
        counts = {k: sum(1 for a in ws.actions if a.op == k) for k in ("F", "B", "W")}
        lines = (out / f"acct_{d}_{s}.jsonl").read_text().splitlines()
        recs = [r for r in map(json.loads, lines) if r["event"] == "step" and r["it"] >= warmup]
        for k, n in counts.items():
            if n:
                ms = statistics.median(r["op_ms"].get(k, 0.0) for r in recs) / n
                per_stage.setdefault(s, {}).setdefault(k, []).append(ms)
    stages = []
    for s, st in enumerate(job.stages):
        got = {k: statistics.mean(v) for k, v in per_stage.get(s, {}).items()}
        stages.append(
            st.model_copy(
                update={
                    "forward": got.get("F", st.forward),
                    "backward_input": got.get("B", st.backward_input),
                    "backward_weight": got.get("W", st.backward_weight),
                }
            )
        )
    return job.model_copy(update={"stages": stages})


def _log_time(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _running_since(out: Path, w: Worker, version: int) -> float | None:
    path = out / f"worker_{w[0]}_{w[1]}.log"
    for line in path.read_text(errors="replace").splitlines():
        if f"running v{version} from iteration" in line:
            return _log_time(line)
    return None


def bench_recovery(job2: JobSpec, kills: int) -> dict:
    """Kill -9 VICTIM `kills` times (a warm standby re-joins in between); per kill: died -> every
    survivor running the new version, from the launcher's event and the survivors' log timestamps."""
    cache: dict[frozenset[Worker], Schedule] = {}
    for failed in (frozenset(), frozenset([VICTIM])):  # precomputed, as the CLI's --schedules directory
        cache[failed] = plan(job2, FailureScenario(failed=sorted(failed)), use_cpsat=False).schedule
    out = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    launcher = Launcher(LaunchSpec(job2, asdict(CFG), 100_000, out), lambda f: cache[f])
    launcher.start()
    survivors = [w for w in launcher.spec.workers() if w != VICTIM]
    to_wall = time.time() - time.monotonic()
    detect, recover = [], []
    try:
        launcher.add_standby(VICTIM)
        for k in range(kills):
            _wait_running(launcher, out, launcher.version, survivors, min_steps=2)
            time.sleep(0.1 + 0.15 * k)  # vary the phase of the kill
            t_kill = time.monotonic()
            launcher.kill(VICTIM)
            while not launcher.poll():
                time.sleep(0.02)
            t_died = next(t for t, kind, w in reversed(launcher.events) if kind == "died")
            version = launcher.version
            times = _wait_running(launcher, out, version, survivors, min_steps=0)
            detect.append(1e3 * (t_died - t_kill))
            recover.append(1e3 * (max(times) - (t_died + to_wall)))
            say(
                f"kill {k + 1}/{kills}: noticed {detect[-1]:.0f} ms, "
                f"survivors on v{version} {recover[-1]:.0f} ms"
            )
            launcher.add_standby(VICTIM)
            launcher.activate(VICTIM)
    finally:
        launcher.terminate()
    return {
        "kills": kills,
        "detect_ms": detect,
        "recover_ms": recover,
        "recover_median_ms": statistics.median(recover),
        "recover_max_ms": max(recover),
        "logs": str(out),
    }


def _wait_running(
    launcher: Launcher, out: Path, version: int, workers: list[Worker], min_steps: int
) -> list[float]:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        launcher.poll()
        times = [_running_since(out, w, version) for w in workers]
        if all(t is not None for t in times) and all(_steps(out, w, version) >= min_steps for w in workers):
            return [t for t in times if t is not None]
        time.sleep(0.05)
    raise TimeoutError(f"workers {workers} not running v{version} within 300 s (logs in {out})")


def _steps(out: Path, w: Worker, version: int) -> int:
    path = out / f"acct_{w[0]}_{w[1]}.jsonl"
    if not path.exists():
        return 0
    return sum(
        1
        for r in map(json.loads, path.read_text().splitlines())
        if r["event"] == "step" and r["version"] == version
    )


def _jobs(stages: list[StageMeasurement], M: int, repeats: int, label: str) -> tuple[JobSpec, JobSpec]:
    """The D=1 and D=2 job specs (P=2) from one set of stage measurements (hops measured here)."""
    job1 = job_spec_from_profile(
        f"bench-d1p2-{label}", stages, measure_comm(HOP, stages, 1, M, repeats), 1, M, None
    )
    job2 = job_spec_from_profile(
        f"bench-d2p2-{label}", stages, measure_comm(HOP, stages, 2, M, repeats), 2, M, None
    )
    return job1, job2


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.runtime")
    sub = ap.add_subparsers(dest="cmd")
    pr = sub.add_parser("_profile")  # internal: one of the concurrent profiling processes
    for a in ("--pipelines", "--microbatches", "--repeats"):
        pr.add_argument(a, type=int, required=True)
    pr.add_argument("--out", required=True)
    ap.add_argument("--out", default="docs/bench/runtime.json")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of ours and Schedule1F1B")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="iterations left out of the medians")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7, help="profiler repeats")
    ap.add_argument("--only", choices=["torch", "fidelity", "recovery"])
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the three benchmarks, print their figures and write them as JSON."""
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)
    if args.cmd == "_profile":
        st = profile_stages(gpt_training(CFG), 2, args.pipelines, args.microbatches, repeats=args.repeats)
        Path(args.out).write_text(json.dumps([asdict(x) for x in st]))
        return 0
    M = args.microbatches
    res: dict[str, Any] = {
        "model": asdict(CFG),
        "num_microbatches": M,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "load_before": os.getloadavg(),
        "profiles": {},
    }
    jobs: dict[str, tuple[JobSpec, JobSpec]] = {}

    def profiled(label: str) -> tuple[JobSpec, JobSpec]:
        """Profile now (in 1, 2 or 3 concurrent processes: label alone / x2 / x3), just before use:
        other load on a shared machine changes by the minute."""
        procs = {"alone": 1, "x2": 2, "x3": 3}[label]
        say(f"profiling {CFG} (P=2, M={M}) in {procs} concurrent process(es)")
        jobs[label] = _jobs(profile_concurrently(procs, 2, M, args.repeats), M, args.repeats, label)
        res["profiles"][label] = json.loads(jobs[label][1].model_dump_json())
        return jobs[label]

    if args.only in (None, "torch"):
        res["vs_torch"] = v = bench_vs_torch(profiled("x2")[0], args.rounds, args.iterations, args.warmup)
        print(f"executor vs Schedule1F1B (D=1, P=2, M={M}): ours {v['ours_median_ms']:.1f} ms, "
              f"torch {v['torch_median_ms']:.1f} ms, ratio {v['ratio']:.3f} (target <= 1.05), "
              f"median per-round ratio {v['median_round_ratio']:.3f}; "
              f"params rel. error {v['params_relative_error']:.1e}; "
              f"1F1B predicted from the x2 profile {v['predicted_1f1b_ms']:.1f} ms")  # fmt: skip
    if args.only in (None, "fidelity"):
        res["fidelity"] = {}
        for label in ("x2", "alone", "x3"):  # x2 first: the comparable condition (see the docstring)
            res["fidelity"][label] = f = bench_fidelity(profiled(label)[1], args.iterations, args.warmup)
            print(f"plan fidelity (D=2, P=2, M={M}, failed [1, 1], profile {label}): predicted "
                  f"{f['predicted_ms']:.1f} ms, measured {f['measured_ms']:.1f} ms, ratio {f['ratio']:.3f} "
                  f"(target within 15%); replay of the same orders with the run's own F/B/W times "
                  f"{f['replayed_with_run_op_ms']:.1f} ms, measured/replay "
                  f"{f['ratio_to_replay']:.3f}")  # fmt: skip
    if args.only in (None, "recovery"):
        res["recovery"] = r = bench_recovery((jobs.get("x2") or profiled("x2"))[1], args.kills)
        print(f"recovery (kill -9 [1, 1], D=2, P=2): died -> survivors running the new version: "
              f"median {r['recover_median_ms']:.0f} ms, max {r['recover_max_ms']:.0f} ms "
              f"over {r['kills']} kills (target < 2000 ms); noticed after kill: "
              f"median {statistics.median(r['detect_ms']):.0f} ms")  # fmt: skip
    res["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
