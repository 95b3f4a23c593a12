"""The per-stage Gantt view: one row per stage, its peers summarized instead of one row each.

At every instant, a stage's row is filled from the bottom with the number of its peers running each
op (F, B, W, BW, OPT stacked in that order), out of the D pipelines; failed peers are a grey band at
the top, and white is idle. So a 16 x 16 grid reads as 16 rows of utilization instead of 256 rows
a few pixels high. Pure layout here; gantt.py draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.contract import JobSpec, Schedule

if TYPE_CHECKING:
    from matplotlib.axes import Axes

STAGE_VIEW_ABOVE = 64  # `--gantt-view auto` draws stages when the grid has more workers than this
_OP_ORDER = ("F", "B", "W", "BW", "OPT")


def gantt_view(job: JobSpec, view: str) -> str:
    """ "workers" or "stages": `view` itself, or for "auto" stages above STAGE_VIEW_ABOVE workers."""
    if view == "auto":
        return "stages" if job.num_pipelines * job.num_stages > STAGE_VIEW_ABOVE else "workers"
    if view not in ("workers", "stages"):
        raise ValueError(f"view must be auto, workers or stages, not {view!r}")
    return view


@dataclass
class StageLayout:
    """`steps[s][op]` = (times, counts): from times[i] to times[i+1] `counts[i]` peers of stage s
    run op (times ascending, counts[-1] == 0). `alive`/`failed`/`slow` count the stage's peers."""

    num_pipelines: int
    labels: list[str]
    alive: list[int]
    failed: list[int]
    steps: list[dict[str, tuple[list[float], list[int]]]] = field(default_factory=list)
    x_max_ms: float = 0.0


def _step(spans: list[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """How many of the (start, end) spans cover each interval between consecutive breakpoints."""
    deltas: dict[float, int] = {}
    for a, b in spans:
        if b > a:
            deltas[a] = deltas.get(a, 0) + 1
            deltas[b] = deltas.get(b, 0) - 1
    times, counts, level = [], [], 0
    for t in sorted(t for t, n in deltas.items() if n):
        level += deltas[t]
        times.append(t)
        counts.append(level)
    return times, counts


def stage_layout(schedule: Schedule, job: JobSpec) -> StageLayout:
    """Per-stage step functions of busy peers per op (pure; no matplotlib)."""
    num_p = job.num_stages
    failed = [0] * num_p
    for _, s in schedule.failed:
        failed[int(s)] += 1
    slow = [0] * num_p
    for sw in schedule.slow or []:
        slow[int(sw.worker[1])] += 1
    alive = [0] * num_p
    spans: list[dict[str, list[tuple[float, float]]]] = [{} for _ in range(num_p)]
    x_max = 0.0
    for ws in schedule.workers:
        s = int(ws.worker[1])
        alive[s] += 1
        for a in ws.actions:
            spans[s].setdefault(a.op, []).append((a.start_ms, a.end_ms))
            x_max = max(x_max, a.end_ms)
    labels = []
    for s in range(num_p):
        label = f"stage {s}: {alive[s]}/{job.num_pipelines} alive"
        labels.append(label + (f", {slow[s]} slow" if slow[s] else ""))
    steps = [{op: _step(by_op[op]) for op in _OP_ORDER if op in by_op} for by_op in spans]
    return StageLayout(job.num_pipelines, labels, alive, failed, steps, x_max)


def draw_stage_rows(ax: Axes, layout: StageLayout, colours: dict[str, str], grey: str, height: float) -> None:
    """Fill each stage's row (centred on y = s, `height` tall, y axis pointing down)."""
    import numpy as np

    scale = height / max(1, layout.num_pipelines)
    x_end = max(layout.x_max_ms, 1e-9)
    for s, by_op in enumerate(layout.steps):
        bottom = s + height / 2
        grid = np.unique(np.concatenate([[0.0, x_end]] + [np.asarray(t) for t, _ in by_op.values()]))
        base = np.zeros_like(grid)
        for op in _OP_ORDER:
            if op not in by_op:
                continue
            times, counts = by_op[op]
            idx = np.searchsorted(np.asarray(times), grid, side="right") - 1
            level = np.where(idx >= 0, np.asarray(counts)[np.maximum(idx, 0)], 0)
            top = base + level
            ax.fill_between(
                grid, bottom - base * scale, bottom - top * scale, step="post", color=colours[op], lw=0
            )
            base = top
        if layout.failed[s]:
            y1 = bottom - height
            ax.fill_between(
                [0.0, x_end], y1, y1 + layout.failed[s] * scale, color=grey, hatch="xx", ec="#7F7F7F", lw=0
            )
        ax.axhline(bottom, color="#404040", linewidth=0.5)
