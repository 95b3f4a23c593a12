"""Layer migration benchmark (CPU, gloo, real processes on this machine).

    python -m bench.migration [--hidden 256] [--layers 4] [--iterations 10] [--empty] [--out FILE.json]

The reference GPT as D=2 x P=2: worker [1, 0] is killed (kill -9) in iteration 2; its schedule (v2)
moves block 1 from stage 0 to stage 1 in both pipelines (planned on planner.partition.derive_job, with
the plan's `migration` estimate); once the survivors stepped twice, [1, 0] re-joins (a warm standby)
and v3 moves the block back. Prints, per version, each worker's measured migration time (from the
plan all-gather to the switch to the new module: the `migration` records) beside the plan's `estimated_ms`
(the moved MiB over `comm.migration_mib_per_ms`, here the loopback gloo bandwidth measured first with
a 4 MiB point-to-point message), the MiB actually sent, and the load average.

`--empty` (any `--layers` >= 3; 6 gives [0, 2) [2, 4) [4, 6)): D=2 x P=3, [1, 1] is killed and v2
leaves stage 1 no layer (its first half of blocks goes to stage 0, the rest to stage 2: [0, 3) [3, 3)
[3, 6)); its survivor [0, 1] sends every block to both pipelines' neighbours, and on the re-join v3
sends them back to it.

The test tests/test_runtime_migration.py runs the same launch (`launch_move_and_back`) on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

from planner.contract import FailureScenario, JobSpec, Schedule
from planner.partition import derive_job, migration
from planner.plan import plan
from runtime_adapter.assignment import Worker
from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.migration_job import with_derived_layers
from runtime_adapter.model import GPTConfig, training
from runtime_adapter.profile_comm import measure_hop_ms
from runtime_adapter.training import split_bounds
from tests.jobs import tiny_job

VICTIM: Worker = (1, 0)
MOVED: dict[frozenset[Worker], list[list[int]]] = {frozenset({VICTIM}): [[0, 1], [1, 4]]}


def partitioned_schedules(job: JobSpec, moved: dict[frozenset[Worker], list[list[int]]]) -> Any:
    """schedule_for(failed set) for a Launcher: the greedy planner's schedule; for a set in `moved`,
    planned on the derived stage-level job and carrying its `partition` and `migration`."""

    def schedule_for(failed: frozenset[Worker]) -> Schedule:
        part, scenario = moved.get(failed), FailureScenario(failed=sorted(failed))
        if part is None:
            return plan(job, scenario, use_cpsat=False).schedule
        doc = plan(derive_job(job, part), scenario, use_cpsat=False).schedule.model_dump(mode="json")
        doc.update(partition=part, migration=migration(job, part, scenario=scenario).model_dump(mode="json"))
        return Schedule.model_validate(doc)

    return schedule_for


def records(out: Path, w: Worker, event: str) -> list[dict[str, Any]]:
    path = out / f"acct_{w[0]}_{w[1]}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["event"] == event]


def launch_move_and_back(
    out: Path,
    job: JobSpec,
    model: dict[str, Any],
    n: int,
    moved: dict[frozenset[Worker], list[list[int]]],
    entry: str | None = None,
    victim: Worker = VICTIM,
) -> Launcher:
    """Kill `victim` (default [1, 0]) before its F of iteration 2 (schedules from `moved`); once
    [0, 0] stepped twice under v2, bring it back from a warm standby; wait for the end (every exit
    code checked by the caller: `launcher.wait(timedelta(seconds=1))` returns them)."""
    spec = LaunchSpec(job, model, n, out, fail_at={victim: (2, "F")}, pace_ms=60)
    if entry is not None:
        spec.entry = entry
    launcher = Launcher(spec, partitioned_schedules(job, moved))
    launcher.start()
    launcher.add_standby(victim)

    def on_tick(lr: Launcher) -> None:
        under_v2 = [r for r in records(out, (0, 0), "step") if r["version"] == 2]
        if victim in lr.failed and lr.standbys.get(victim) and len(under_v2) >= 2:
            lr.activate(victim)

    launcher.wait(timedelta(seconds=600), on_tick)
    return launcher


def empty_middle(num_layers: int) -> list[list[int]]:
    """P=3: stage 1's blocks (the even split's) go to its neighbours, the first half to stage 0."""
    b = split_bounds(num_layers, 3)
    mid = (b[1] + b[2]) // 2
    return [[0, mid], [mid, mid], [mid, num_layers]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.migration", description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--empty", action="store_true", help="P=3; v2 leaves stage 1 no layer")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.empty:
        if args.layers < 3:
            ap.error("--layers: at least 3 with --empty (one per stage at home)")
        num_stages, victim, part = 3, (1, 1), empty_middle(args.layers)
    elif args.layers != 4:
        ap.error("--layers: only 4 (the moves are [0, 2) / [2, 4) -> [0, 1) / [1, 4)); any >= 3 with --empty")
    else:
        num_stages, victim, part = 2, VICTIM, MOVED[frozenset({VICTIM})]
    cfg = GPTConfig(hidden=args.hidden, num_heads=4, num_layers=args.layers, seq_len=32)
    hop_ms = measure_hop_ms((1 << 20,))  # 4 MiB of float32 between two gloo ranks on loopback
    bandwidth = 4.0 / hop_ms
    job = with_derived_layers(
        tiny_job(2, num_stages, 2), training(**asdict(cfg)), optimizer_copies=1, mib_per_ms=bandwidth
    )
    estimate = migration(job, part, scenario=FailureScenario(failed=[victim]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        moved = {frozenset({victim}): part}
        launcher = launch_move_and_back(out, job, asdict(cfg), args.iterations, moved, victim=victim)
        codes = launcher.wait(timedelta(seconds=1))
        keys = ("version", "from", "to", "ms", "sent_mib", "received_mib", "phases_ms")
        rows = [
            {"worker": list(w), **{k: r[k] for k in keys}}
            for w in sorted(codes)
            for r in records(out, w, "migration")
        ]
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"gloo loopback bandwidth {bandwidth:.2f} MiB/ms (4 MiB in {hop_ms:.2f} ms); load average {load}")
    print(f"plan: moves {[m.model_dump() for m in estimate.moves]}, {estimate.mib:.2f} MiB per pipeline, "
          f"estimated {estimate.estimated_ms:.2f} ms")  # fmt: skip
    print("worker   version  layers          measured ms  sent MiB  received MiB  "
          "(plan / transfer / build / agree / switch ms)")  # fmt: skip
    for r in rows:
        phases = " / ".join(f"{v:.1f}" for v in r["phases_ms"].values())
        print(f"{r['worker']!s:8} v{r['version']:<7} {r['from']!s:>7} -> {r['to']!s:7} {r['ms']:10.1f}"
              f"  {r['sent_mib']:8.2f}  {r['received_mib']:12.2f}  ({phases})")  # fmt: skip
    print(f"exit codes {dict((f'{d},{s}', c) for (d, s), c in codes.items())}")
    if args.out is not None:
        doc = {"hidden": args.hidden, "layers": args.layers, "partition": part,
               "bandwidth_mib_per_ms": bandwidth, "estimate": estimate.model_dump(),
               "rows": rows, "loadavg": load, "cpus": os.cpu_count()}  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
