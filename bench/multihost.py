"""Multi-host figures: three "hosts" as network namespaces, each with one `recycle agent`, and the
planner service and the rendezvous store (`recycle store`) in a fourth (bench/multihost_cluster.py
has the set-up and the scenarios: crash, partition, store, stage).

    python -m bench.multihost [--reps 3] [--iterations 30] [--heartbeat-timeout 2]
                              [--scenarios crash,partition,store,stage] [--out docs/bench/multihost.json]

Needs root (CAP_NET_ADMIN) for `ip netns`; the namespaces come from tests/netns.py. Medians over
`--reps`; a table on stdout, everything as JSON in `--out`. tests/test_multihost.py runs each scenario
once, with assertions on the outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.multihost_cluster import PIPELINES, SCENARIOS, STAGES, MultiHost, Outcome, say
from runtime_adapter.model import GPTConfig
from tests.netns import netns_unavailable


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Per scenario: repetitions and the median of each time (and of the store figures)."""
    out: dict[str, dict[str, Any]] = {}
    keys = ("detect_s", "running_s", "step_s", "cutoff_exit_s", "rejoin_s", "steps_without_store",
            "lost_iterations")  # fmt: skip
    for scenario in SCENARIOS:
        runs = [o for o in outcomes if o.scenario == scenario]
        if not runs:
            continue
        out[scenario] = {"runs": len(runs), "running_s_all": [round(o.running_s, 3) for o in runs]}
        for k in keys:
            out[scenario][k] = _median([getattr(o, k) for o in runs if getattr(o, k) is not None])
        if scenario == "store":
            out[scenario]["lost_iterations_max"] = max(o.lost_iterations or 0 for o in runs)
    return out


NAMES = {
    "crash": "host crash (agent + workers kill -9)",
    "partition": "partition (link down)",
    "store": "store kill -9 + restart, then a worker kill -9",
    "stage": "stage 1 lost on every host (restore)",
}


def table(summary: dict[str, dict[str, Any]], heartbeat_timeout_s: float) -> str:
    """The medians as a text table, with issue 9's targets."""

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    targets = {
        "crash": "< 2 s",
        "partition": f"<= {heartbeat_timeout_s + 1:g} s (timeout + 1 s)",
        "store": "iterations lost = 0",
        "stage": "-",
    }
    head: tuple[str, ...] = ("scenario", "runs", "detected", "running new version", "first step",
                             "other", "target")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for scenario, m in summary.items():
        times = [fmt(m[k]) for k in ("detect_s", "running_s", "step_s")]
        other = "-"
        if scenario == "partition":
            other = f"cut-off exit {fmt(m['cutoff_exit_s'])}, re-joined {fmt(m['rejoin_s'])}"
        elif scenario == "store":
            other = (f"steps without store {m['steps_without_store']:g}, "
                     f"iterations lost {m['lost_iterations_max']}")  # fmt: skip
        rows.append((NAMES[scenario], str(m["runs"]), *times, other, targets[scenario]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + (
        f"\n(seconds from the fault, medians; heartbeat timeout {heartbeat_timeout_s:g} s; partition: "
        "cut-off exit and re-join from the link coming back; running = every worker that goes on wrote "
        "its record of the new version)"
    )


def _run_all(root: Path, args: argparse.Namespace, scenarios: list[str]) -> tuple[list[Outcome], list[str]]:
    """Every repetition of every scenario on one MultiHost: the outcomes and the failures' messages."""
    outcomes: list[Outcome] = []
    errors: list[str] = []
    with MultiHost(root, heartbeat_timeout_s=args.heartbeat_timeout) as mh:
        for rep in range(args.reps):
            for scenario in scenarios:
                say(f"{scenario} {rep + 1}/{args.reps} ...")
                try:
                    o = mh.run_scenario(scenario, root / f"{scenario}-{rep}", args.iterations, args.pace_ms)
                except (TimeoutError, RuntimeError) as e:
                    errors.append(f"{scenario} {rep + 1}: {e}")
                    say(f"  failed: {e}")
                    continue
                outcomes.append(o)
                say(f"  detected {o.detect_s:.2f} s, running {o.running_s:.2f} s, "
                    f"first step {o.step_s:.2f} s, agents {o.agent_codes}")  # fmt: skip
    return outcomes, errors


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.multihost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each scenario (default 3)")
    ap.add_argument("--iterations", type=int, default=30, help="iterations of each job (default 30)")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="workers' --pace-ms (default 0)")
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0, help="the job's heartbeat timeout, s")
    ap.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ",".join(SCENARIOS)
    )
    ap.add_argument("--out", default="docs/bench/multihost.json", help="JSON figures (default %(default)s)")
    ap.add_argument("--keep", help="keep the runs' directories (logs, accounting files) here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    if not scenarios or any(s not in SCENARIOS for s in scenarios):
        print(f"error: --scenarios takes {','.join(SCENARIOS)}", file=sys.stderr)
        return 2
    if args.reps < 1 or args.iterations < 10 or not args.heartbeat_timeout > 0:
        print("error: --reps >= 1, --iterations >= 10 and --heartbeat-timeout > 0", file=sys.stderr)
        return 2
    reason = netns_unavailable()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the namespaces are removed on the way out
    import tempfile

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-multihost-"))
    load_before = list(os.getloadavg())
    try:
        outcomes, errors = _run_all(root, args, scenarios)
    except KeyboardInterrupt:
        print("interrupted (every process and namespace of this run is gone)", file=sys.stderr)
        return 130
    summary = summarize(outcomes)
    print(table(summary, args.heartbeat_timeout))
    doc = {
        "what": "seconds from the fault to: detected (the job shows it: the victims failed, or a restore), "
        "running (every worker that goes on recovered into that version), first step (each stepped under "
        "it); partition: cut-off exit and re-join from the link coming back; store: steps taken while it "
        "was down, iterations rolled back by its restart",
        "job": {
            "pipelines": PIPELINES,
            "stages": STAGES,
            "microbatches": 4,
            "model": asdict(GPTConfig()),
            "iterations": args.iterations,
            "pace_ms": args.pace_ms,
        },
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "heartbeat_check_s": 0.2,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "load_before": load_before,
        "medians": summary,
        "runs": [asdict(o) for o in outcomes],
        "errors": errors,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"figures written to {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
