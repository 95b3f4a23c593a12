"""Runtime-as-a-library benchmark (issue 10; CPU, gloo, real worker processes on this machine).

    python -m bench.library [--only overhead|hf|clip] [--out docs/bench/library.json]

1. overhead: the reference GPT through the public API (`runtime_adapter.model:training`, this tree)
   vs the executor of commit fb50286 (the commit before the library work, extracted with
   `git archive` into --old-tree and run there in its own process with its own bench.runtime.run_ours).
   Same model (bench.runtime.CFG), job (D=1, P=2, M=8, the planner's 1F1B order), iterations and
   harness; the two alternate `--rounds` times. Per-iteration median wall time of the steady state
   (accounting records, bench.runtime.steady_ms), the ratio new / old, where the time goes per
   instruction kind, and an in-process micro-profile of what the library adds per iteration (float64
   gradient sums, the per-forward reseeding).
2. hf: the transformers example (examples.hf_gpt2, entry `examples.hf_gpt2:training`), D=2, P=2, M=2:
   a failure-free run and one where worker [1, 1] gets SIGKILL after its first step; the loss at the
   first and the last iteration (loss.csv), the largest relative parameter difference of the surviving
   workers between the two runs and against single-process training (reference.train_reference).
3. clip: AdamW with no clipping, per-stage clipping and global-norm clipping (D=2, P=2, M=8, the
   planner's failure-free schedule), alternating; per-iteration medians per worker and stage, and
   global - stage: the cost of the world all-reduce of the P squared norms (a barrier).

Figures go to stdout (a short table per section), progress to stderr, everything to --out (JSON; the
sections not run this time are kept from the file). Every run carries the load average
(os.getloadavg) before and after it and the mean number of runnable tasks while it ran (`timed`).
Besides the median of the run medians (the figure), the fastest run's median and the lower quartile
of all steady iterations are given: less sensitive to other work on a shared machine.
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
import threading
import time
from dataclasses import asdict
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.runtime import CFG, _jobs, _op_breakdown, run_ours, say, steady_ms
from planner.baselines import baseline_schedule
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.plan import plan
from runtime_adapter.accounting import read_records
from runtime_adapter.assignment import Worker
from runtime_adapter.entry import load_entry
from runtime_adapter.grad_sum import GradSum
from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.model import gpt_training
from runtime_adapter.profile import profile_stages
from runtime_adapter.profile_comm import job_spec_from_profile, measure_comm
from runtime_adapter.progress import LOSS_CSV, JobMonitor
from runtime_adapter.reference import relative_error, train_reference
from runtime_adapter.stage import StageRunner, infer_shapes
from runtime_adapter.training import microbatch_seed

ROOT = Path(__file__).resolve().parent.parent
OLD_COMMIT = "fb50286"  # the commit before the library work: "today's executor"
HF_ENTRY = "examples.hf_gpt2:training"
HF_MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 32, "microbatch_size": 4, "clip": 1.0,
            "clip_scope": "global"}  # fmt: skip
VICTIM: Worker = (1, 1)
CLIP_VARIANTS: dict[str, dict[str, Any]] = {
    "none": {"optimizer": "adamw"},
    "stage": {"optimizer": "adamw", "clip": 1.0, "clip_scope": "stage"},
    "global": {"optimizer": "adamw", "clip": 1.0, "clip_scope": "global"},
}
# Runs the old tree's own harness (bench.runtime.run_ours of fb50286: LaunchSpec took a GPTConfig)
# on the job and schedule files given; prints its result as JSON on the last line.
OLD_DRIVER = """
import json, sys
from pathlib import Path
import runtime_adapter.executor
from bench.runtime import run_ours
from planner.contract import JobSpec, Schedule
assert runtime_adapter.executor.__file__.startswith(sys.argv[5]), runtime_adapter.executor.__file__
job = JobSpec.model_validate_json(Path(sys.argv[1]).read_text())
schedule = Schedule.model_validate_json(Path(sys.argv[2]).read_text())
print(json.dumps(run_ours(job, schedule, int(sys.argv[3]), int(sys.argv[4]), set())))
"""


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def _runnable() -> int:
    """Tasks runnable on the whole machine right now (/proc/loadavg), less this reader itself."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        return -1


def timed(fn: Any, *args: Any) -> dict[str, Any]:
    """`fn(*args)` (a dict) plus the load average before and after it and the mean number of runnable
    tasks sampled every 0.1 s while it ran (the run's own busy workers included: about 2 for a quiet
    D=1 P=2 run, up to 4 for D=2 P=2; more means other work shared the cores)."""
    before, samples, stop = load(), list[int](), threading.Event()

    def sample() -> None:
        while not stop.wait(0.1):
            samples.append(_runnable())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        res = dict(fn(*args))
    finally:
        stop.set()
        sampler.join()
    res["load_before"], res["load_after"] = before, load()
    res["runnable_mean"] = round(statistics.mean(samples), 2) if samples else None
    return res


def iteration_walls(out: Path, workers: list[Worker], warmup: int) -> list[float]:
    """Per steady-state iteration (from `warmup` on), the slowest worker's wall_ms (accounting)."""
    per_it: dict[int, float] = {}
    for w in workers:
        for r in read_records(out, w):
            if r.get("event") == "step" and r["it"] >= warmup:
                per_it[r["it"]] = max(per_it.get(r["it"], 0.0), float(r["wall_ms"]))
    return [per_it[it] for it in sorted(per_it)]


def spread(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Over `runs` (each with iteration_ms and walls): the median of the run medians (the figure),
    the fastest run's median and the lower quartile of every steady iteration (less load-sensitive)."""
    pooled = sorted(x for r in runs for x in r["walls"])
    return {
        "median_ms": statistics.median(r["iteration_ms"] for r in runs),
        "best_run_ms": min(r["iteration_ms"] for r in runs),
        "p25_iteration_ms": statistics.quantiles(pooled, n=4)[0],
    }


def by_stage(per_worker: dict[str, float]) -> dict[str, float]:
    """Per stage: the slowest of its workers' medians ("d,s" keys)."""
    out: dict[str, float] = {}
    for key, ms in per_worker.items():
        s = key.split(",")[1]
        out[s] = max(out.get(s, 0.0), ms)
    return dict(sorted(out.items()))


# -- 1. overhead: the public API vs the executor of fb50286 -----------------------------------------


def old_tree(path: Path) -> Path:
    """The source tree of OLD_COMMIT at `path` (extracted with git archive, read-only, if missing)."""
    if not (path / "runtime_adapter" / "executor.py").exists():
        path.mkdir(parents=True, exist_ok=True)
        say(f"extracting {OLD_COMMIT} into {path}")
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", OLD_COMMIT], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    return path


def run_old(tree: Path, job: JobSpec, schedule: Schedule, iterations: int, warmup: int) -> dict[str, Any]:
    """One run of fb50286's executor (its own run_ours, in a process whose imports are the old tree)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-library-old-"))
    (tmp / "job.json").write_text(job.model_dump_json())
    (tmp / "schedule.json").write_text(schedule.model_dump_json())
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    args = [str(tmp / "job.json"), str(tmp / "schedule.json"), str(iterations), str(warmup), str(tree)]
    proc = subprocess.run(
        [sys.executable, "-c", OLD_DRIVER, *args], cwd=tree, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the old executor's run failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _grads_fb50286(params: list[torch.nn.Parameter], grads: list[torch.Tensor], M: int) -> None:
    """fb50286's gradient handling of one iteration: autograd accumulates M micro-batches into .grad
    in float32, OPT flattens them for the all-reduce and clones each parameter's slice back."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()  # the first micro-batch's gradient (autograd's fresh tensor)
    for _ in range(M - 1):
        for p, g in zip(params, grads, strict=True):
            assert p.grad is not None
            p.grad.add_(g)  # autograd accumulates the next ones in place
    flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def _grads_float64(gs: GradSum, grads: list[torch.Tensor], M: int) -> None:
    """This tree's: a fresh .grad per micro-batch moved into the float64 sums (GradSum.add), a float64
    flat vector for the all-reduce, each parameter's slice cast back to float32."""
    for _ in range(M):
        for p, g in zip(gs.params, grads, strict=True):
            p.grad = g.clone()  # autograd's fresh tensor: .grad is None before every backward
        gs.add()
    gs.set_grads(gs.flat(torch.device("cpu")))
    gs.clear()


def _grads_float64_in_place(sums: list[torch.Tensor], gs: GradSum, grads: list[torch.Tensor], M: int) -> None:
    """As _grads_float64 but adding each float32 gradient into kept float64 buffers in place (no
    float64 copy per micro-batch; the same float64 values, so the same bits): a possible speed-up."""
    for s in sums:
        s.zero_()
    for _ in range(M):
        for p, g, s in zip(gs.params, grads, sums, strict=True):
            p.grad = g.clone()
            s.add_(p.grad)
            p.grad = None
    gs.set_grads(torch.cat([s.reshape(-1) for s in sums]))


def _reseed(M: int, stage: int) -> None:
    """The per-forward reseeding of one iteration (M forwards on the stage)."""
    for m in range(M):
        torch.manual_seed(microbatch_seed(0, 7, 0, m, stage))


def _reseed_cpu_generator(M: int, stage: int) -> None:
    """The same seeds into the CPU generator only (torch.manual_seed also queues lazy CUDA/XPU/MPS
    seeding calls, each with a traceback.format_stack(), whose cost grows with the stack depth)."""
    for m in range(M):
        torch.default_generator.manual_seed(microbatch_seed(0, 7, 0, m, stage))


def _alternating_ms(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median ms of each function, run in turn `repeats` times after one warm-up call each (turns
    alternate so that drifting load hits all of them alike)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(1e3 * (time.perf_counter() - t))
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def _forwards(runner: StageRunner, module: torch.nn.Module, M: int, wrapped: bool) -> None:
    """M forwards of the stage (autograd on, as in training): through StageRunner.forward (reseeding,
    autocast context, boundary cast) if `wrapped`, else the module and loss called directly."""
    tr = runner.training
    for m in range(M):
        inputs, targets = runner.read(3, 0, m)
        inp = inputs if runner.is_first else torch.randn(runner.input_shape)
        assert inp is not None
        if wrapped:
            runner.forward(module, 3, (0, m), inp, targets)
        else:
            out = module(inp)
            if runner.is_last:
                assert targets is not None
                tr.loss(out, targets)


def micro_profile(M: int, repeats: int = 9) -> dict[str, dict[str, float]]:
    """Per stage of the bench model (P=2), ms per iteration of M micro-batches (one thread), median of
    `repeats` in alternation: fb50286's gradient handling vs this tree's float64 sums (and an in-place
    variant), the per-forward reseeding (microbatch_seed + torch.manual_seed, M times on each stage;
    and the CPU generator alone), and M forwards called directly vs through StageRunner.forward."""
    training = gpt_training(CFG)
    shapes = infer_shapes(training, 2)
    res = {}
    for s in range(2):
        runner = StageRunner(training, s, 2, torch.device("cpu"), shapes)
        module = runner.build()
        params = [p for p in module.parameters() if p.requires_grad]
        grads = [torch.randn_like(p) for p in params]
        sums = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
        fns = {
            "grads_fb50286_ms": partial(_grads_fb50286, params, grads, M),
            "grads_float64_ms": partial(_grads_float64, GradSum(params), grads, M),
            "grads_float64_in_place_ms": partial(_grads_float64_in_place, sums, GradSum(params), grads, M),
            "reseed_ms": partial(_reseed, M, s),
            "reseed_cpu_generator_ms": partial(_reseed_cpu_generator, M, s),
            "forwards_direct_ms": partial(_forwards, runner, module, M, False),
            "forwards_stage_runner_ms": partial(_forwards, runner, module, M, True),
        }
        ms = _alternating_ms(fns, repeats)
        ms["grads_extra_ms"] = round(ms["grads_float64_ms"] - ms["grads_fb50286_ms"], 3)
        res[str(s)] = {"num_params": sum(p.numel() for p in params), **ms}
    return res


def bench_overhead(job1: JobSpec, tree: Path, rounds: int, iterations: int, warmup: int) -> dict[str, Any]:
    """Alternate this tree's executor (public API) and fb50286's on the same job and 1F1B order."""
    schedule = baseline_schedule("1f1b", job1, FailureScenario())
    runs: dict[str, list[dict[str, Any]]] = {"new": [], "old": [], "new_float32": []}
    order = ["old", "new", "new_float32"]
    for r in range(rounds):
        for who in order[r % 3 :] + order[: r % 3]:  # rotate: drifting load hits every variant alike
            if who == "old":
                res = timed(run_old, tree, job1, schedule, iterations, warmup)
            else:  # new_float32: exact_sums=False, fb50286's float32 gradient arithmetic
                options = {"exact_sums": who == "new"}
                res = timed(run_ours, job1, schedule, iterations, warmup, set(), options)
            res["op_ms"] = _op_breakdown(Path(res["out"]), warmup)
            res["walls"] = iteration_walls(Path(res["out"]), [(0, 0), (0, 1)], warmup)
            runs[who].append(res)
            say(
                f"overhead round {r + 1}/{rounds} {who}: {res['iteration_ms']:.1f} ms/iteration "
                f"{res['per_worker_ms']} load {res['load_after']} runnable {res['runnable_mean']}"
            )
    stats = {who: spread(runs[who]) for who in runs}
    new_ms, old_ms = stats["new"]["median_ms"], stats["old"]["median_ms"]
    pairs = [n["iteration_ms"] / o["iteration_ms"] for n, o in zip(runs["new"], runs["old"], strict=True)]
    fast_ms = stats["new_float32"]["median_ms"]
    op_kinds = sorted({k for x in runs["new"] + runs["old"] for w in x["op_ms"].values() for k in w})
    op_median = {
        who: {
            w: {
                k: round(statistics.median(x["op_ms"][w].get(k, 0.0) for x in runs[who]), 2) for k in op_kinds
            }
            for w in runs[who][0]["op_ms"]
        }
        for who in runs
    }
    return {
        "job": {"D": 1, "P": 2, "M": job1.num_microbatches, "schedule": "1f1b (planner baseline)"},
        "old_commit": OLD_COMMIT,
        "new_median_ms": new_ms,
        "old_median_ms": old_ms,
        "ratio": new_ms / old_ms,
        "new_float32_median_ms": fast_ms,
        "float32_ratio": fast_ms / old_ms,
        "float32_best_run_ratio": stats["new_float32"]["best_run_ms"] / stats["old"]["best_run_ms"],
        "spread": stats,
        "best_run_ratio": stats["new"]["best_run_ms"] / stats["old"]["best_run_ms"],
        "p25_ratio": stats["new"]["p25_iteration_ms"] / stats["old"]["p25_iteration_ms"],
        "round_ratios": pairs,
        "median_round_ratio": statistics.median(pairs),
        "op_ms_median": op_median,
        "micro_profile_ms": micro_profile(job1.num_microbatches),
        "runs": runs,
    }


# -- 3. clip: AdamW with no, per-stage and global-norm clipping -------------------------------------


def run_gpt(job: JobSpec, schedule: Schedule, model: dict[str, Any], iterations: int, warmup: int) -> dict:
    """One failure-free run of the reference GPT with `model` (entry kwargs); steady-state medians."""
    out = Path(tempfile.mkdtemp(prefix="bench-library-"))
    launcher = Launcher(LaunchSpec(job, model, iterations, out), lambda _f: schedule)
    launcher.start()
    codes = launcher.wait(timedelta(seconds=600))
    if any(c != 0 for c in codes.values()):
        raise RuntimeError(f"job failed: {codes} (logs in {out})")
    per_worker = steady_ms(out, launcher.spec.workers(), warmup)
    return {
        "out": str(out),
        "per_worker_ms": per_worker,
        "per_stage_ms": by_stage(per_worker),
        "iteration_ms": max(per_worker.values()),
        "walls": iteration_walls(out, launcher.spec.workers(), warmup),
        "op_ms": _op_breakdown(out, warmup),
    }


def bench_clip(job2: JobSpec, rounds: int, iterations: int, warmup: int) -> dict[str, Any]:
    """Alternate no clipping, per-stage and global-norm clipping (AdamW) on the failure-free plan."""
    schedule = plan(job2, FailureScenario(), use_cpsat=False).schedule
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in CLIP_VARIANTS}
    names = list(CLIP_VARIANTS)
    for r in range(rounds):
        for v in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order each round
            model = {**asdict(CFG), **CLIP_VARIANTS[v]}
            res = timed(run_gpt, job2, schedule, model, iterations, warmup)
            runs[v].append(res)
            say(
                f"clip round {r + 1}/{rounds} {v}: {res['iteration_ms']:.1f} ms/iteration "
                f"{res['per_worker_ms']} load {res['load_after']} runnable {res['runnable_mean']}"
            )
    stats = {v: spread(runs[v]) for v in runs}
    med = {v: stats[v]["median_ms"] for v in runs}
    stage_med = {
        v: {s: statistics.median(x["per_stage_ms"][s] for x in runs[v]) for s in runs[v][0]["per_stage_ms"]}
        for v in runs
    }
    opt_med = {
        v: {w: statistics.median(x["op_ms"][w].get("OPT", 0.0) for x in runs[v]) for w in runs[v][0]["op_ms"]}
        for v in runs
    }
    diff = med["global"] - med["stage"]
    return {
        "job": {"D": 2, "P": 2, "M": job2.num_microbatches, "schedule": "planner, failure-free (greedy)"},
        "variants": CLIP_VARIANTS,
        "median_ms": med,
        "per_stage_median_ms": stage_med,
        "opt_op_ms_median": opt_med,
        "global_minus_stage_ms": diff,
        "global_minus_stage_pct": 100.0 * diff / med["stage"],
        "spread": stats,
        "global_minus_stage_p25_ms": stats["global"]["p25_iteration_ms"] - stats["stage"]["p25_iteration_ms"],
        "global_minus_stage_best_run_ms": stats["global"]["best_run_ms"] - stats["stage"]["best_run_ms"],
        "stage_minus_none_ms": med["stage"] - med["none"],
        "round_diffs_ms": [
            g["iteration_ms"] - s["iteration_ms"] for g, s in zip(runs["global"], runs["stage"], strict=True)
        ],
        "runs": runs,
    }


# -- 2. hf: the transformers example, failure-free and with a SIGKILL -------------------------------


def hf_job(D: int, P: int, M: int, repeats: int) -> JobSpec:
    """The example's job spec, profiled here (as `recycle profile --entry` does)."""
    training = load_entry(HF_ENTRY, HF_MODEL)
    stages = profile_stages(training, P, D, M, repeats=repeats)
    hop = max(infer_shapes(training, P), key=lambda sh: torch.Size(sh).numel())
    return job_spec_from_profile(
        f"hf-gpt2-d{D}p{P}m{M}", stages, measure_comm(hop, stages, D, M, repeats), D, M, None
    )


def run_hf(job: JobSpec, schedules: dict[frozenset[Worker], Schedule], iterations: int, kill: bool) -> dict:
    """Launch the example (paced so the kill lands early); SIGKILL VICTIM after its first step if
    `kill`. Losses from <out>/loss.csv (written by the launch CLI's JobMonitor, polled here)."""
    out = Path(tempfile.mkdtemp(prefix="bench-library-hf-"))
    spec = LaunchSpec(job, HF_MODEL, iterations, out, entry=HF_ENTRY, pace_ms=150)
    launcher = Launcher(spec, lambda f: schedules[f])
    monitor = JobMonitor(out, job.num_pipelines, job.num_stages, job.num_microbatches)
    victim_acct = launcher.acct_path(VICTIM)
    killed: list[bool] = []

    def tick(lr: Launcher) -> None:
        monitor.poll()
        if kill and not killed and victim_acct.exists() and '"step"' in victim_acct.read_text():
            lr.kill(VICTIM)
            killed.append(True)

    launcher.start()
    t0 = time.monotonic()
    codes = launcher.wait(timedelta(seconds=600), tick)
    wall_s = time.monotonic() - t0
    monitor.poll()
    survivors = [w for w in spec.workers() if w not in launcher.failed]
    if any(codes[w] != 0 for w in survivors) or (kill and launcher.failed != {VICTIM}):
        raise RuntimeError(f"hf run failed: {codes}, failed {launcher.failed} (logs in {out})")
    rows = [line.split(",") for line in (out / LOSS_CSV).read_text().splitlines()[1:]]
    losses = {int(it): float(loss) for it, loss, _ in rows}
    died = [e.iteration for e in launcher.history if e.kind == "died"]
    return {
        "out": str(out),
        "wall_s": wall_s,
        "failed": sorted(list(w) for w in launcher.failed),
        "died_in_iteration": died[0] if died else None,
        "loss_first": losses[0],
        "loss_last": losses[iterations - 1],
        "losses": [losses[i] for i in sorted(losses)],
        "survivors": [list(w) for w in survivors],
    }


def bench_hf(iterations: int, repeats: int) -> dict[str, Any]:
    """Failure-free vs SIGKILL of VICTIM; parameters against each other and single-process training."""
    D, P, M = 2, 2, 2
    say(f"profiling {HF_ENTRY} {HF_MODEL} (D={D}, P={P}, M={M})")
    job = hf_job(D, P, M, repeats)
    schedules = {
        f: plan(job, FailureScenario(failed=sorted(f)), use_cpsat=False).schedule
        for f in (frozenset(), frozenset([VICTIM]))
    }
    ff = timed(run_hf, job, schedules, iterations, False)
    say(f"hf failure-free: loss {ff['loss_first']:.4f} -> {ff['loss_last']:.4f} load {ff['load_after']}")
    kd = timed(run_hf, job, schedules, iterations, True)
    say(f"hf kill -9: loss {kd['loss_first']:.4f} -> {kd['loss_last']:.4f} load {kd['load_after']}")
    say(f"single-process training of the same Training ({iterations} iterations)")
    torch.set_num_threads(1)
    ref_losses: list[float] = []
    ref = train_reference(load_entry(HF_ENTRY, HF_MODEL), D, P, M, iterations, losses=ref_losses)

    def final(run: dict[str, Any], w: list[int]) -> dict[str, torch.Tensor]:
        return dict(torch.load(Path(run["out"]) / f"final_{w[0]}_{w[1]}.pt"))

    kill_vs_ff = {
        f"{d},{s}": relative_error(final(kd, [d, s]), final(ff, [d, s])) for d, s in kd["survivors"]
    }
    vs_ref = {
        name: {f"{d},{s}": relative_error(final(run, [d, s]), ref[s]) for d, s in run["survivors"]}
        for name, run in (("failure_free", ff), ("killed", kd))
    }
    return {
        "job": {"D": D, "P": P, "M": M, "iterations": iterations, "entry": HF_ENTRY, "model": HF_MODEL},
        "failure_free": ff,
        "killed": kd,
        "reference_loss_first": ref_losses[0],
        "reference_loss_last": ref_losses[-1],
        "killed_vs_failure_free_max_rel": max(kill_vs_ff.values()),
        "killed_vs_failure_free_rel": kill_vs_ff,
        "vs_single_process_max_rel": {k: max(v.values()) for k, v in vs_ref.items()},
        "vs_single_process_rel": vs_ref,
        "losses_equal_reference": {
            k: run["losses"] == [float(f"{x:.6g}") for x in ref_losses]
            for k, run in (("failure_free", ff), ("killed", kd))
        },
    }


# -- the command --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.library")
    ap.add_argument("--out", default="docs/bench/library.json")
    ap.add_argument("--only", choices=["overhead", "hf", "clip"])
    ap.add_argument("--rounds", type=int, default=5, help="alternations (overhead and clip)")
    ap.add_argument("--iterations", type=int, default=20, help="iterations per run (overhead and clip)")
    ap.add_argument("--warmup", type=int, default=4, help="iterations left out of the medians")
    ap.add_argument("--microbatches", type=int, default=8, help="M of the overhead and clip jobs")
    ap.add_argument("--hf-iterations", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3, help="profiler repeats (job specs to plan from)")
    ap.add_argument("--old-tree", default=str(Path(tempfile.gettempdir()) / f"recycle-{OLD_COMMIT}"),
                    help=f"where {OLD_COMMIT} is (extracted with git archive if missing)")  # fmt: skip
    return ap


def _print_overhead(o: dict[str, Any]) -> None:
    print(f"\noverhead: reference GPT through the public API vs {OLD_COMMIT}'s executor "
          f"(D=1, P=2, M={o['job']['M']}, per-iteration medians of the steady state, ms)")  # fmt: skip
    print("| round | fb50286 | public API | new/old | runnable old / new | load after new (1/5/15 min) |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for i, (n, o_) in enumerate(zip(o["runs"]["new"], o["runs"]["old"], strict=True)):
        print(f"| {i + 1} | {o_['iteration_ms']:.1f} | {n['iteration_ms']:.1f} | "
              f"{n['iteration_ms'] / o_['iteration_ms']:.3f} | "
              f"{o_['runnable_mean']} / {n['runnable_mean']} | {n['load_after']} |")  # fmt: skip
    sp = o["spread"]
    print(f"| median | {o['old_median_ms']:.1f} | {o['new_median_ms']:.1f} | {o['ratio']:.3f} | | |")
    print(f"| fastest run | {sp['old']['best_run_ms']:.1f} | {sp['new']['best_run_ms']:.1f} | "
          f"{o['best_run_ratio']:.3f} | | |")  # fmt: skip
    print(f"| lower quartile of all iterations | {sp['old']['p25_iteration_ms']:.1f} | "
          f"{sp['new']['p25_iteration_ms']:.1f} | {o['p25_ratio']:.3f} | | |")  # fmt: skip
    print(f"ratio of medians {o['ratio']:.3f}, median per-round ratio {o['median_round_ratio']:.3f} "
          f"(target <= 1.05: {'met' if o['ratio'] <= 1.05 else 'missed'})")  # fmt: skip
    print(f"with exact_sums=False (float32 gradient sums, fb50286's arithmetic): median "
          f"{o['new_float32_median_ms']:.1f} ms, ratio {o['float32_ratio']:.3f}, fastest-run ratio "
          f"{o['float32_best_run_ratio']:.3f} (target <= 1.05: "
          f"{'met' if o['float32_ratio'] <= 1.05 else 'missed'})")  # fmt: skip
    for w in o["op_ms_median"]["new"]:
        old_, new_ = o["op_ms_median"]["old"][w], o["op_ms_median"]["new"][w]
        parts = ", ".join(f"{k} {old_[k]:.1f}->{new_[k]:.1f}" for k in new_ if old_[k] or new_[k])
        print(f"worker {w} ms per iteration by instruction (old->new, median over runs): {parts}")
    for s, m in o["micro_profile_ms"].items():
        print(f"stage {s} micro-profile ({m['num_params']} params, ms per iteration of {o['job']['M']} "
              f"micro-batches): gradients fb50286 {m['grads_fb50286_ms']:.1f}, float64 sums "
              f"{m['grads_float64_ms']:.1f} (+{m['grads_extra_ms']:.1f}; in place "
              f"{m['grads_float64_in_place_ms']:.1f}); reseeding {m['reseed_ms']:.2f} (CPU generator only "
              f"{m['reseed_cpu_generator_ms']:.2f}); forwards direct "
              f"{m['forwards_direct_ms']:.1f}, through StageRunner.forward "
              f"{m['forwards_stage_runner_ms']:.1f}")  # fmt: skip


def _print_hf(h: dict[str, Any]) -> None:
    j = h["job"]
    print(f"\nhf: {j['entry']} {json.dumps(j['model'])}, D={j['D']}, P={j['P']}, M={j['M']}, "
          f"{j['iterations']} iterations")  # fmt: skip
    print("| run | loss first | loss last | max rel. diff vs failure-free | vs single-process | load after |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    ff, kd = h["failure_free"], h["killed"]
    print(f"| failure-free | {ff['loss_first']:.4f} | {ff['loss_last']:.4f} | - | "
          f"{h['vs_single_process_max_rel']['failure_free']:.1e} | {ff['load_after']} |")  # fmt: skip
    print(f"| kill -9 [1, 1] (died in iteration {kd['died_in_iteration']}) | {kd['loss_first']:.4f} | "
          f"{kd['loss_last']:.4f} | {h['killed_vs_failure_free_max_rel']:.1e} | "
          f"{h['vs_single_process_max_rel']['killed']:.1e} | {kd['load_after']} |")  # fmt: skip
    print(f"| single-process | {h['reference_loss_first']:.4f} | {h['reference_loss_last']:.4f} | | | |")
    print(f"loss.csv equals the single-process losses (6 digits): {h['losses_equal_reference']}")


def _print_clip(c: dict[str, Any]) -> None:
    print(f"\nclip: reference GPT, AdamW, D=2, P=2, M={c['job']['M']} (per-iteration medians of the "
          "steady state, ms; median over rounds)")  # fmt: skip
    print("| clipping | iteration | stage 0 | stage 1 | fastest run | lower quartile | OPT op per worker "
          "| runnable per round |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for v, ms in c["median_ms"].items():
        st, sp = c["per_stage_median_ms"][v], c["spread"][v]
        opt = ", ".join(f"[{w}] {x:.1f}" for w, x in c["opt_op_ms_median"][v].items())
        runnable = ", ".join(str(r["runnable_mean"]) for r in c["runs"][v])
        print(f"| {v} | {ms:.1f} | {st['0']:.1f} | {st['1']:.1f} | {sp['best_run_ms']:.1f} | "
              f"{sp['p25_iteration_ms']:.1f} | {opt} | {runnable} |")  # fmt: skip
    one_min = [r["load_after"][0] for runs in c["runs"].values() for r in runs]
    print(f"global - stage: {c['global_minus_stage_ms']:+.1f} ms ({c['global_minus_stage_pct']:+.1f}%) "
          f"median, {c['global_minus_stage_best_run_ms']:+.1f} ms fastest run, "
          f"{c['global_minus_stage_p25_ms']:+.1f} ms lower quartile; per round "
          f"{[round(x, 1) for x in c['round_diffs_ms']]}; stage - none {c['stage_minus_none_ms']:+.1f} ms; "
          f"1-min load after the runs {min(one_min):.2f}-{max(one_min):.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the sections, print their figures and write them (merged into --out) as JSON."""
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.monotonic()
    out = Path(args.out)
    res: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    res["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    res["model"] = asdict(CFG)
    M = args.microbatches
    gpt_jobs: tuple[JobSpec, JobSpec] | None = None

    def jobs() -> tuple[JobSpec, JobSpec]:
        nonlocal gpt_jobs
        if gpt_jobs is None:
            say(f"profiling {CFG} (P=2, M={M}) for the job specs to plan from")
            stages = profile_stages(gpt_training(CFG), 2, 2, M, repeats=args.repeats)
            gpt_jobs = _jobs(stages, M, args.repeats, "library")
        return gpt_jobs

    def finish(name: str, section: dict[str, Any]) -> None:
        section["finished_at"] = datetime.now().isoformat(timespec="seconds")
        res[name] = section
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")

    if args.only in (None, "overhead"):
        tree = old_tree(Path(args.old_tree))
        finish("overhead", bench_overhead(jobs()[0], tree, args.rounds, args.iterations, args.warmup))
        _print_overhead(res["overhead"])
    if args.only in (None, "hf"):
        finish("hf", bench_hf(args.hf_iterations, args.repeats))
        _print_hf(res["hf"])
    if args.only in (None, "clip"):
        finish("clip", bench_clip(jobs()[1], args.rounds, args.iterations, args.warmup))
        _print_clip(res["clip"])
    took = time.monotonic() - t_start
    res.setdefault("command_s", {})[args.only or "all"] = round(took, 1)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwritten {out} ({took:.0f} s, load now {load()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
