"""`recycle whatif`: throughput retained per strategy for 0..k failures, worst case and average.

For each failure count, every normalized scenario (or, past `max_scenarios`, a seeded uniform
sample of placements) is evaluated by every strategy; averages weight each canonical scenario by
the number of physical placements it stands for. Throughput retained is failure-free 1F1B's
iteration time over the strategy's (every strategy trains the whole global batch per iteration).
A strategy that is fatal under a scenario falls back to checkpoint-restart's configuration for it
(the shrink configuration, or nothing when no pipeline is fully alive); such cells are marked.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from planner.contract import FailureScenario, JobSpec
from whatif.scenarios import Canonical, scenarios_for
from whatif.strategies import CheckpointRestart, Strategy

if TYPE_CHECKING:
    from whatif.events import RunFigures

log = logging.getLogger(__name__)


@dataclass
class Cell:
    """One strategy at one failure count."""

    strategy: str
    num_failures: int
    worst_retained: float
    mean_retained: float
    worst_ms: float | None  # None: some placement left nothing running
    mean_ms: float | None
    fallback_share: float  # fraction of placements where the strategy was fatal (fell back)
    worst_failed: list[list[int]]


@dataclass
class WhatIf:
    """The table: cells by failure count then strategy, and how each row was covered."""

    job: str
    baseline_1f1b_ms: float
    cells: list[Cell]
    coverage: dict[int, dict[str, Any]]  # k -> {"scenarios", "exhaustive", "physical"}

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "baseline_1f1b_ms": self.baseline_1f1b_ms,
            "coverage": {str(k): v for k, v in self.coverage.items()},
            "cells": [asdict(c) for c in self.cells],
        }


def effective_ms(
    strategy: Strategy, fallback: CheckpointRestart, scenario: FailureScenario
) -> tuple[float | None, bool]:
    """(iteration time, fell back): the strategy's own, or checkpoint-restart's when fatal."""
    out = strategy.outcome(scenario)
    if not out.fatal:
        return out.iteration_time_ms, False
    return fallback.outcome(scenario).iteration_time_ms, True


def evaluate(
    job: JobSpec,
    strategies: dict[str, Strategy],
    fallback: CheckpointRestart,
    baseline_ms: float,
    scenarios_by_k: dict[int, tuple[list[Canonical], bool]],
) -> WhatIf:
    """Fill the table from already-chosen scenarios (plans are fetched or made by the strategies)."""
    cells: list[Cell] = []
    coverage: dict[int, dict[str, Any]] = {}
    for k, (scenarios, exhaustive) in sorted(scenarios_by_k.items()):
        weight_total = sum(c.placements for c in scenarios)
        coverage[k] = {"scenarios": len(scenarios), "exhaustive": exhaustive, "placements": weight_total}
        for name, strat in strategies.items():
            worst, worst_ms, worst_failed = float("inf"), 0.0, []
            acc_retained = acc_ms = fell = 0.0
            stalled = False
            for c in scenarios:
                ms, fell_back = effective_ms(strat, fallback, c.scenario)
                retained = baseline_ms / ms if ms else 0.0
                if ms is None:
                    stalled = True
                acc_retained += retained * c.placements
                acc_ms += (ms or 0.0) * c.placements
                fell += c.placements if fell_back else 0
                if retained < worst:
                    worst, worst_ms = retained, ms or 0.0
                    worst_failed = [list(w) for w in c.scenario.failed]
            cells.append(
                Cell(
                    strategy=name,
                    num_failures=k,
                    worst_retained=worst,
                    mean_retained=acc_retained / weight_total,
                    worst_ms=None if stalled else worst_ms,
                    mean_ms=None if stalled else acc_ms / weight_total,
                    fallback_share=fell / weight_total,
                    worst_failed=worst_failed,
                )
            )
    return WhatIf(job.name, baseline_ms, cells, coverage)


def choose_scenarios(
    job: JobSpec, max_failures: int, max_scenarios: int, seed: int
) -> dict[int, tuple[list[Canonical], bool]]:
    """Scenarios per failure count 0..max_failures (all canonical, or a seeded sample)."""
    return {k: scenarios_for(job, k, max_scenarios, seed) for k in range(max_failures + 1)}


def render(result: WhatIf, strategies: list[str]) -> str:
    """Plain-text table: one row per strategy, worst / mean throughput retained per failure count;
    '*' marks cells where some placements fell back to checkpoint-restart."""
    ks = sorted(result.coverage)
    by = {(c.strategy, c.num_failures): c for c in result.cells}
    head = ["strategy"] + [f"k={k} worst/mean" for k in ks]
    rows = [head]
    for name in strategies:
        row = [name]
        for k in ks:
            c = by[name, k]
            mark = "*" if c.fallback_share > 0 else ""
            row.append(f"{c.worst_retained:6.1%} / {c.mean_retained:6.1%}{mark}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [
        f"throughput retained = failure-free 1F1B iteration time ({result.baseline_1f1b_ms:.1f} ms)"
        " / iteration time",
        "* some placements are unrecoverable for that strategy: it falls back to checkpoint-restart there",
    ]
    for k in ks:
        cov = result.coverage[k]
        how = "all" if cov["exhaustive"] else "a seeded sample of"
        notes.append(f"k={k}: {how} {cov['scenarios']} normalized scenarios ({cov['placements']} placements)")
    return "\n".join([*lines, "", *notes])


def render_runs(runs: dict[str, RunFigures], estimates: dict[str, dict[str, Any]] | None = None) -> str:
    """The `recycle simulate` table: one row per strategy, numbers right-aligned under their header.
    `estimates`: strategy -> {"estimated": failure sets estimated, "note": a line on them}; a
    strategy whose figures rest on at least one estimate is marked `~`; the notes go under the table."""
    estimates = estimates or {}
    marked = {n for n, e in estimates.items() if e.get("estimated")}
    from planner.outputs import render_table

    head = [
        "strategy",
        "samples",
        "samples/s",
        "vs 1F1B",
        "vs own",
        "recovery h",
        "lost h",
        "ckpt h",
        "stalled h",
        "fallbacks",
    ]
    rows = [
        [
            name + (" ~" if name in marked else ""),
            f"{r.samples:,.0f}",
            f"{r.effective_throughput:.2f}",
            f"{r.retained_vs_1f1b:.1%}",
            f"{r.retained_vs_own:.1%}",
            f"{r.recovery_s / 3600:.2f}",
            f"{r.lost_work_s / 3600:.2f}",
            f"{r.checkpoint_s / 3600:.2f}",
            f"{r.stalled_s / 3600:.2f}",
            str(r.checkpoint_fallbacks),
        ]
        for name, r in runs.items()
    ]
    gpu_h = next(iter(runs.values())).gpu_hours if runs else 0.0
    notes = [
        "vs 1F1B / vs own: samples over what failure-free 1F1B / the strategy itself would train",
        "hours: recovery = switches and restarts, lost = rolled back to a checkpoint, ckpt = writing",
        "checkpoints, stalled = nothing could run; fallbacks: failures that forced a checkpoint restore",
        f"GPU-hours (allocated, every strategy): {gpu_h:.0f}",
    ]
    if marked:
        notes.append("~ rests on estimated iteration times (the plan cache missed those failure sets):")
    notes.extend(str(estimates[n]["note"]) for n in runs if n in estimates)
    return "\n".join([render_table(head, rows, align="l" + "r" * 9), *notes])
