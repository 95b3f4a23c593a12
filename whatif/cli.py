"""`recycle whatif`, `recycle simulate` and `recycle precompute`: parsers and commands.

The `recycle` dispatcher (recycle_cli/) wires them in with `add_whatif_parsers(sub)`; each command returns an
exit code and raises planner.errors.InvalidInputError for bad input (exit 2 there).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from planner.cli_io import finite_float
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError
from whatif.cache import PlanCache
from whatif.cli_precompute import add_precompute_parser, cmd_precompute
from whatif.strategies import (
    ALL_STRATEGIES,
    EXTRA_STRATEGIES,
    CheckpointRestart,
    Costs,
    Strategy,
    make_strategies,
)
from whatif.trace import parse_duration

log = logging.getLogger(__name__)

LLAMA3_GPU_MTBF_H = (
    50_700.0  # GPU-hours between failures per GPU (Meta, Llama 3; /work/shared/FAILURE_RATES.md)
)
MAX_CHECKPOINTS = 2_000_000  # checkpoints one simulated run may take (each is a timeline segment)
# A trace with more failures than DENSE_FAILURES, and more than DENSE_WORK failures x workers, gets a
# warning: each failure is a new failure set, replayed on up to the whole grid (a small grid is quick).
DENSE_FAILURES = 1_000
DENSE_WORK = 200_000


def _duration(default_unit: str = "h") -> Any:
    def parse(text: str) -> float:
        try:
            return parse_duration(text, default_unit)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job spec JSON (docs/contract.md section 1)")
    p.add_argument(
        "--plans",
        help="plan cache directory (from `recycle precompute`): whatif plans the failure sets it misses "
        "and adds them (creating it if missing); simulate estimates them unless --exact",
    )
    p.add_argument(
        "--strategies",
        default=",".join(ALL_STRATEGIES),
        help=f"comma-separated strategies (default: all of {', '.join(ALL_STRATEGIES)}; opt-in: "
        f"{', '.join(EXTRA_STRATEGIES)}, docs/strategies.md)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="processes for cache misses: plans, and the baselines' replays (default 2)",
    )
    p.add_argument(
        "--time-limit", type=finite_float, default=3.0, help="greedy budget per plan, seconds (default 3)"
    )
    c = p.add_argument_group("recovery costs (durations: number with unit s/m/h/d; bare numbers are seconds)")
    c.add_argument("--checkpoint-cost", type=_duration("s"), default=Costs.checkpoint_s)
    c.add_argument("--restart-cost", type=_duration("s"), default=Costs.restart_s)
    c.add_argument("--reroute-cost", type=_duration("s"), default=Costs.reroute_s)
    c.add_argument("--failover-cost", type=_duration("s"), default=Costs.failover_s)
    c.add_argument("--reconfig-cost", type=_duration("s"), default=Costs.reconfig_s)
    c.add_argument("--checkpoint-interval", type=_duration("s"), default=None, help="default: Young/Daly")
    c.add_argument("--spares", action="store_true", help="restarts replace failed workers from spares")


def _load(
    args: argparse.Namespace, exact: bool = True
) -> tuple[JobSpec, Costs, PlanCache, dict[str, Strategy], CheckpointRestart]:
    from planner.cli_io import read_document

    job = read_document(args.job, JobSpec, "job spec")
    costs = Costs(
        checkpoint_s=args.checkpoint_cost,
        restart_s=args.restart_cost,
        reroute_s=args.reroute_cost,
        failover_s=args.failover_cost,
        reconfig_s=args.reconfig_cost,
        checkpoint_interval_s=args.checkpoint_interval,
        spares=args.spares,
    )
    if args.time_limit <= 0 or args.workers < 1:
        raise InvalidInputError("--time-limit must be positive and --workers at least 1")
    if args.checkpoint_interval is not None and args.checkpoint_interval <= 0:
        raise InvalidInputError("--checkpoint-interval must be above 0 (omit it for Young/Daly's interval)")
    names = tuple(n.strip() for n in args.strategies.split(",") if n.strip())
    if not names:
        raise InvalidInputError("--strategies: name at least one strategy")
    cache = PlanCache(args.plans)
    limit = timedelta(seconds=args.time_limit)
    try:
        strategies = make_strategies(job, costs, cache, names, limit, exact=exact)
    except ValueError as exc:
        raise InvalidInputError(f"--strategies: {exc}") from None
    fallback = make_strategies(job, costs, cache, ("checkpoint-restart",), limit)["checkpoint-restart"]
    assert isinstance(fallback, CheckpointRestart)
    return job, costs, cache, strategies, fallback


def _write_json(path: str | None, payload: dict[str, Any]) -> None:
    from planner.cli_io import write_output

    if path:
        write_output(path, json.dumps(payload, indent=1) + "\n", "--json")


def _check_outputs(args: argparse.Namespace, files: tuple[str, ...]) -> None:
    """Refuse unwritable output paths and picture types other than PNG/SVG before any work."""
    from planner.cli_io import PICTURE_SUFFIXES, check_output, check_output_dir

    check_output_dir(args.plans, "--plans")
    for name in files:
        flag = "--" + name.replace("_", "-")
        check_output(getattr(args, name), flag, PICTURE_SUFFIXES if name == "plot" else None)


@contextmanager
def _writing(flag: str, path: str) -> Iterator[None]:
    """A write error (disk full, /proc, ...) after the work is done: one line naming the flag."""
    try:
        yield
    except OSError as exc:
        raise InvalidInputError(f"{flag} {path}: cannot write: {exc.strerror or exc}") from exc


def _plot_path(path: str) -> Path:
    from planner.cli_io import make_parent

    return make_parent(path, "--plot")


def add_whatif_parser(sub: Any) -> None:
    """`recycle whatif JOB --max-failures K`."""
    p = sub.add_parser("whatif", help="throughput retained per strategy for 0..k failures")
    _add_common(p)
    p.add_argument(
        "--max-failures",
        type=int,
        default=3,
        help="evaluate 0, 1, ..., K failed workers (default 3); a row per count",
    )
    p.add_argument(
        "--max-scenarios", type=int, default=64, help="per failure count; past it, sample placements"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for sampled placements")
    p.add_argument("--plot", metavar="PATH.png|PATH.svg", help="write a plot here (PNG or SVG, by suffix)")
    p.add_argument("--json", metavar="PATH", help="write the table as JSON here")
    p.set_defaults(func=cmd_whatif)


def cmd_whatif(args: argparse.Namespace) -> int:
    """Print the what-if table; optionally plot and write JSON."""
    from whatif.precompute import plan_missing
    from whatif.prefetch import prefetch
    from whatif.structured import failure_free_1f1b_ms
    from whatif.table import choose_scenarios, evaluate, render

    _check_outputs(args, ("plot", "json"))
    job, _, cache, strategies, fallback = _load(args)
    if args.max_failures < 0 or args.max_scenarios < 1:
        raise InvalidInputError("--max-failures must be >= 0 and --max-scenarios >= 1")
    if args.max_failures > job.num_pipelines * job.num_stages:
        raise InvalidInputError(
            f"--max-failures {args.max_failures}: the job has {job.num_pipelines * job.num_stages} workers"
        )
    t0 = time.perf_counter()
    chosen = choose_scenarios(job, args.max_failures, args.max_scenarios, args.seed)
    every = [c for scenarios, _ in chosen.values() for c in scenarios]
    if {"recycle", "recycle+barrier"} & set(strategies):
        plan_missing(job, every, cache, args.workers, time_limit=timedelta(seconds=args.time_limit))
    prefetch(job, strategies, [c.scenario for c in every], args.workers)
    result = evaluate(job, strategies, fallback, failure_free_1f1b_ms(job), chosen)
    print(render(result, list(strategies)))
    print(f"(done in {time.perf_counter() - t0:.1f} s)", flush=True)
    _write_json(args.json, result.to_dict())
    if args.plot:
        from whatif.plots import plot_whatif

        with _writing("--plot", args.plot):
            plot_whatif(result, list(strategies), _plot_path(args.plot))
    return 0


def add_simulate_parser(sub: Any) -> None:
    """`recycle simulate JOB (--trace CSV | --job-mtbf 6h | --mtbf 1536h) --repair 2h --duration 7d`."""
    p = sub.add_parser(
        "simulate",
        help="event-driven run of every strategy over a failure trace",
        description="Event-driven run of every strategy over a failure/rejoin trace. recycle's plans "
        "come from --plans DIR when it holds them; a failure set it does not hold is ESTIMATED by the "
        "memory-aware lower bound (milliseconds instead of seconds of planning; labelled in the table "
        "and the JSON) unless --exact, which plans every failure set first (docs/whatif.md).",
    )
    _add_common(p)
    p.add_argument(
        "--exact",
        action="store_true",
        help="plan every failure set the trace visits (added to --plans) instead of estimating the "
        "ones the plan cache misses; slower, and reports what the estimate would have changed",
    )
    p.add_argument("--trace", help="CSV of time,worker,event (see docs/whatif.md)")
    mtbf = p.add_mutually_exclusive_group()
    mtbf.add_argument(
        "--mtbf",
        type=_duration("h"),
        help="mean time between failures of ONE worker (e.g. 6h; a bare number is hours)",
    )
    mtbf.add_argument(
        "--job-mtbf",
        type=_duration("h"),
        help="mean time between failures of the whole job, any worker (e.g. 6h; a bare number is hours): "
        "--mtbf this times the number of workers; with --trace it sets the checkpoint interval only",
    )
    p.add_argument(
        "--gpu-mtbf",
        type=_duration("h"),
        default=LLAMA3_GPU_MTBF_H * 3600,
        help="per-GPU MTBF, divided by --gpus-per-worker without --mtbf/--job-mtbf "
        "(default: Llama 3's 50,700 h)",
    )
    p.add_argument("--gpus-per-worker", type=int, help="default: the spec's model.tensor_parallel, else 1")
    p.add_argument(
        "--repair",
        type=_duration("h"),
        default=2 * 3600.0,
        help="repair time (default 2h; a bare number is hours)",
    )
    p.add_argument(
        "--duration",
        type=_duration("h"),
        default=7 * 86400.0,
        help="run length (default 7d; a bare number is hours)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--plot", metavar="PATH.png|PATH.svg", help="write a plot of throughput over time here (PNG or SVG)"
    )
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON here")
    p.add_argument("--write-trace", metavar="PATH", help="write the (generated) trace as CSV here")
    p.set_defaults(func=cmd_simulate)


def _gpus_per_worker(job: JobSpec, given: int | None) -> int:
    if given is not None:
        if given < 1:
            raise InvalidInputError("--gpus-per-worker must be at least 1")
        return given
    model = getattr(job, "model", None)
    tp = model.get("tensor_parallel") if isinstance(model, dict) else None
    return int(tp) if isinstance(tp, int) and tp > 0 else 1


def _warn_if_dense(events: list[Any], args: argparse.Namespace, job_mtbf: float, num_workers: int) -> None:
    """A dense trace (DENSE_FAILURES, DENSE_WORK) gets a warning before the run: each event is a new
    failure set, and once every pipeline is touched each baseline replays the whole grid, so such a
    run takes long (docs/whatif.md); --mtbf is per worker, a job-level figure is --job-mtbf."""
    in_run = [e for e in events if e.time_s < args.duration]
    failures = sum(e.kind == "fail" for e in in_run)
    if failures <= DENSE_FAILURES or failures * num_workers <= DENSE_WORK:
        return
    down: set[Any] = set()
    most = 0
    for e in in_run:
        (down.add if e.kind == "fail" else down.discard)(e.worker)
        most = max(most, len(down))
    per_worker = (
        f" (--mtbf {args.mtbf / 3600:.3g} h is per worker: {job_mtbf / 60:.3g} min for the job's "
        f"{num_workers} workers; --job-mtbf gives the job's MTBF)"
        if args.mtbf is not None and args.job_mtbf is None and not args.trace
        else ""
    )
    print(
        f"warning: {failures:,} failures over {args.duration / 3600:g} h{per_worker}, up to {most} workers "
        "down at once: each event is a new failure set to estimate and replay, so this run can take "
        "long (progress is shown)",
        file=sys.stderr,
    )


def _failure_sets(events: list[Any]) -> list[FailureScenario]:
    down: set[tuple[int, int]] = set()
    out = []
    for e in events:
        (down.add if e.kind == "fail" else down.discard)(e.worker)
        out.append(FailureScenario(failed=sorted(down)))
    return out


def estimate_report(
    job: JobSpec, strategies: dict[str, Strategy], events: list[Any], duration_s: float
) -> dict[str, dict[str, Any]]:
    """Per recycle model (and recycle+repartition): which failure sets were estimated, the share of
    the run spent in them, and how far the estimate is from the plan where both are known
    (whatif/estimate.py)."""
    from planner.normalize import normalize
    from whatif.estimate import ESTIMATE_METHOD, barrier_estimate_ms, estimate_of
    from whatif.strategies import Recycle, RecycleRepartition

    played = [e for e in events if e.time_s < duration_s]
    time_by_key: dict[str, float] = {}
    for sc, start, end in zip(
        [FailureScenario(), *_failure_sets(played)],
        [0.0, *(e.time_s for e in played)],
        [*(e.time_s for e in played), duration_s],
        strict=True,
    ):
        key = normalize(job, sc).key
        time_by_key[key] = time_by_key.get(key, 0.0) + max(0.0, end - start)
    out: dict[str, dict[str, Any]] = {}
    for name, strat in strategies.items():
        if not isinstance(strat, (Recycle, RecycleRepartition)):
            continue
        field = strat._field if isinstance(strat, Recycle) else "iteration_time_ms"
        sets, errors = [], []
        for key, rec in strat.used.items():
            entry: dict[str, Any] = {
                "failed": rec.get("scenario", {}).get("failed", []),
                "estimated": bool(rec.get("estimated")),
                "iteration_time_ms": rec.get(field),
                "time_s": time_by_key.get(key, 0.0),
            }
            estimate = estimate_of(rec)
            if estimate is not None and field == "barrier_ms":
                scenario = FailureScenario.model_validate(rec["scenario"])
                estimate = barrier_estimate_ms(job, scenario, estimate)
            if estimate is not None and rec.get(field):
                entry["estimate_ms"] = estimate
                entry["estimate_error"] = estimate / float(rec[field]) - 1.0
                errors.append(entry["estimate_error"])
            sets.append(entry)
        estimated = [s for s in sets if s["estimated"]]
        share = sum(s["time_s"] for s in estimated) / duration_s if duration_s > 0 else 0.0
        known = (
            f"; where a plan is known ({len(errors)} sets) the estimate is {_pct(_mean(errors))} on "
            f"average, {_pct(max(errors, key=abs))} at worst"
            if errors
            else ""
        )
        note = (
            f"{name}: {len(estimated)} of {len(sets)} failure sets estimated ({ESTIMATE_METHOD}, "
            f"{share:.1%} of the run){known}"
        )
        out[name] = {
            "failure_sets": len(sets),
            "estimated": len(estimated),
            "estimated_time_share": share,
            "estimate_error_where_planned": (
                {"sets": len(errors), "mean": _mean(errors), "worst": max(errors, key=abs)}
                if errors
                else None
            ),
            "sets": sets,
            "note": note,
        }
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _pct(value: float) -> str:
    return f"{value:+.2%}"


def check_estimates(
    strategies: dict[str, Strategy],
    runs: dict[str, Any],
    report: dict[str, dict[str, Any]],
    play: Callable[[dict[str, Strategy]], dict[str, Any]],
) -> None:
    """--exact: replay (`play`) the recycle models with every failure set estimated, and record in
    `report` how far the final answer (samples trained) moves: what leaving out --exact would cost."""
    from whatif.strategies import Recycle

    for name, strat in strategies.items():
        if not isinstance(strat, Recycle) or name not in runs:
            continue
        guess = type(strat)(strat.job, strat.costs, strat.cache, exact=False, use_plans=False)
        planned, estimated = runs[name].samples, play({name: guess})[name].samples
        diff = estimated / planned - 1.0 if planned else 0.0
        report[name]["all_estimated_samples"] = estimated
        report[name]["all_estimated_difference"] = diff
        report[name]["note"] += f"; all estimated, samples would differ by {_pct(diff)}"


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the trace through every strategy; print the figures; optionally plot and write JSON."""
    from planner.normalize import normalize
    from whatif.estimate import ESTIMATE_METHOD
    from whatif.events import simulate
    from whatif.precompute import plan_missing
    from whatif.prefetch import prefetch
    from whatif.scenarios import Canonical
    from whatif.strategies import young_daly_interval_s
    from whatif.structured import failure_free_1f1b_ms
    from whatif.table import render_runs
    from whatif.trace import generate_trace, read_trace, write_trace

    t0 = time.perf_counter()
    _check_outputs(args, ("plot", "json", "write_trace"))
    job, costs, cache, strategies, fallback = _load(args, exact=args.exact)
    gpus = _gpus_per_worker(job, args.gpus_per_worker)
    num_workers = job.num_pipelines * job.num_stages
    for flag, value in (("--mtbf", args.mtbf), ("--job-mtbf", args.job_mtbf)):
        if value is not None and value <= 0:
            raise InvalidInputError(f"{flag} must be above 0")
    if args.job_mtbf is not None:
        args.mtbf = args.job_mtbf * num_workers
        if not math.isfinite(args.mtbf):
            raise InvalidInputError(f"--job-mtbf {args.job_mtbf:g} s over {num_workers} workers is too large")
    worker_mtbf = args.mtbf if args.mtbf is not None else args.gpu_mtbf / gpus
    if args.trace:
        events = read_trace(args.trace, job)
        late = sum(e.time_s >= args.duration for e in events)
        if late:
            print(
                f"warning: --trace {args.trace}: {late} event(s) at or after --duration "
                f"{args.duration / 3600:.1f} h are not played (give a longer --duration to include them)",
                file=sys.stderr,
            )
    else:
        events = generate_trace(job, worker_mtbf, args.repair, args.duration, args.seed)
    played = sum(e.kind == "fail" and e.time_s < args.duration for e in events)
    from_trace = bool(args.trace) and args.mtbf is None  # the job MTBF is duration / failures
    job_mtbf = args.duration / max(1, played) if from_trace else worker_mtbf / num_workers
    _warn_if_dense(events, args, job_mtbf, num_workers)
    if args.write_trace:
        from planner.cli_io import make_parent

        with _writing("--write-trace", args.write_trace):
            write_trace(events, make_parent(args.write_trace, "--write-trace"))
    if costs.checkpoint_interval_s is None and costs.checkpoint_s <= 0:
        raise InvalidInputError("--checkpoint-cost must be positive unless --checkpoint-interval is given")
    interval = (
        costs.checkpoint_interval_s
        if costs.checkpoint_interval_s is not None
        else young_daly_interval_s(job_mtbf, costs.checkpoint_s)
    )
    if args.duration / interval > MAX_CHECKPOINTS:
        raise InvalidInputError(
            f"a checkpoint every {interval:.3g} s over --duration {args.duration:g} s is "
            f"{args.duration / interval:.3g} checkpoints; at most {MAX_CHECKPOINTS:,} are simulated "
            "(raise --checkpoint-interval or --checkpoint-cost, or shorten --duration)"
        )
    if args.exact and {"recycle", "recycle+barrier"} & set(strategies):
        sets = [normalize(job, sc) for sc in _failure_sets(events)]
        todo = [Canonical(n.scenario, n.key, 1) for n in sets]
        plan_missing(job, todo, cache, args.workers, time_limit=timedelta(seconds=args.time_limit))
    base_ms = failure_free_1f1b_ms(job)

    def play(models: dict[str, Strategy], progress: bool = False) -> dict[str, Any]:
        return simulate(
            job, models, fallback, events, args.duration, costs, interval, base_ms, gpus, progress=progress
        )

    prefetch(job, strategies, _failure_sets([e for e in events if e.time_s < args.duration]), args.workers)
    runs = play(strategies, progress=True)
    mtbf_text = f"job MTBF {job_mtbf / 3600:.2f} h"
    if from_trace:
        mtbf_text = (
            f"{mtbf_text} (the trace's)"
            if played
            else f"job MTBF above {job_mtbf / 3600:.2f} h (no failure within --duration)"
        )
    print(
        f"{job.name}: {played} failures over {args.duration / 3600:.1f} h, "
        f"{mtbf_text}, checkpoint every {interval / 60:.1f} min "
        f"({'given' if costs.checkpoint_interval_s else 'Young/Daly'}), spares: {costs.spares}"
    )
    report = estimate_report(job, strategies, events, args.duration)
    if args.exact and report:
        check_estimates(strategies, runs, report, play)
    print(render_runs(runs, report))
    for other in ("oobleck", "bamboo", "checkpoint-restart", "shrink"):
        if "recycle" in runs and other in runs and runs[other].samples > 0:
            r = runs["recycle"]
            print(
                f"recycle / {other}: {r.samples / runs[other].samples:.3f}x samples "
                f"({r.retained_vs_own / max(runs[other].retained_vs_own, 1e-12):.3f}x relative to each "
                "one's own failure-free throughput)"
            )
    print(f"(done in {time.perf_counter() - t0:.1f} s)", flush=True)
    payload = {
        "job": job.name,
        "duration_s": args.duration,
        "job_mtbf_s": job_mtbf,
        "checkpoint_interval_s": interval,
        "costs": costs.__dict__,
        "num_failures": sum(e.kind == "fail" and e.time_s < args.duration for e in events),  # played ones
        "strategies": {n: r.to_dict() for n, r in runs.items()},
        "recycle_estimates": {
            "method": ESTIMATE_METHOD,
            "exact": bool(args.exact),
            "strategies": {n: {k: v for k, v in r.items() if k != "note"} for n, r in report.items()},
        },
    }
    _write_json(args.json, payload)
    if args.plot:
        from whatif.plots import plot_simulation

        base_rate = job.num_pipelines * job.num_microbatches / (base_ms / 1000.0)
        title = f"{job.name}: throughput over time"
        with _writing("--plot", args.plot):
            plot_simulation(runs, args.duration, base_rate, _plot_path(args.plot), title)
    return 0


def add_whatif_parsers(sub: Any) -> None:
    """Register whatif, simulate and precompute on the `recycle` subparsers."""
    add_whatif_parser(sub)
    add_simulate_parser(sub)
    add_precompute_parser(sub)


__all__ = ["add_whatif_parsers", "cmd_precompute", "cmd_simulate", "cmd_whatif"]
