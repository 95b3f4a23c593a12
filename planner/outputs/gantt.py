"""A schedule as a Gantt chart (PNG or SVG): one row per worker, bars coloured by op, x axis in ms.

Large grids get one row per stage instead (gantt_stages.py).

Rows are ordered by stage then pipeline and labelled "[d,s]"; a failed worker keeps its row,
greyed and crossed, so the hole in the grid is visible. Re-routed work (a micro-batch of another
pipeline than the worker's) is hatched with a dark edge. Bars are the informative first-iteration
start_ms/end_ms. Drawing uses one compound path per (op, re-routed) over all rows (ten artists in
all), so a 256-worker x 200-op schedule renders in a couple of seconds.

matplotlib is imported lazily and drawn through an explicit Agg canvas on a standalone Figure:
no pyplot global state, no backend switch, never a window.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from planner.contract import JobSpec, Schedule
from planner.outputs.gantt_stages import draw_stage_rows, gantt_view, stage_layout

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.path import Path as MplPath

logger = logging.getLogger(__name__)

OP_COLOURS: dict[str, str] = {
    "F": "#4C78A8",  # blue
    "B": "#54A24B",  # green
    "W": "#F2A93B",  # amber
    "BW": "#8E6CC4",  # purple
    "OPT": "#D6404E",  # red
}
_OP_ORDER = ("F", "B", "W", "BW", "OPT")
_FAILED_GREY = "#D9D9D9"
_BAR_HEIGHT = 0.8
_MAX_FAILED_IN_TITLE = 8
_MAX_BAR_LABELS = 600


@dataclass
class GanttLayout:
    """What the chart shows, as plain data (the drawing step only paints it).

    `rows[i]` is the worker of row i (row 0 at the top); `labels[i]` its tick label; `failed_rows`
    the rows of failed workers; `bars[(op, rerouted)]` the (row, start_ms, duration_ms) of every
    action of that kind.
    """

    rows: list[tuple[int, int]]
    labels: list[str]
    failed_rows: list[int]
    bars: dict[tuple[str, bool], list[tuple[int, float, float]]] = field(default_factory=dict)
    x_max_ms: float = 0.0


def gantt_layout(schedule: Schedule, job: JobSpec) -> GanttLayout:
    """Rows, labels and bars of the Gantt chart of `schedule` (pure; no matplotlib)."""
    if schedule.job != job.name:
        logger.warning("schedule is for job %r but the job spec is %r", schedule.job, job.name)
    by_worker = {(int(w.worker[0]), int(w.worker[1])): w for w in schedule.workers}
    failed = {(int(d), int(s)) for d, s in schedule.failed}
    slow = {(int(sw.worker[0]), int(sw.worker[1])): sw.factor for sw in schedule.slow or []}
    rows = sorted(set(by_worker) | failed, key=lambda w: (w[1], w[0]))

    labels: list[str] = []
    failed_rows: list[int] = []
    bars: dict[tuple[str, bool], list[tuple[int, float, float]]] = {}
    x_max = 0.0
    for i, (d, s) in enumerate(rows):
        if (d, s) not in by_worker:
            labels.append(f"[{d},{s}] failed")
            failed_rows.append(i)
            continue
        factor = slow.get((d, s))
        labels.append(f"[{d},{s}]" + (f" x{factor:g}" if factor is not None else ""))
        for a in by_worker[(d, s)].actions:
            rerouted = a.mb is not None and int(a.mb[0]) != d
            bars.setdefault((a.op, rerouted), []).append((i, a.start_ms, max(0.0, a.end_ms - a.start_ms)))
            x_max = max(x_max, a.end_ms)
    if bars and x_max <= 0.0:
        logger.warning("schedule %r has no action times (all end_ms are 0); the chart is empty", schedule.job)
    return GanttLayout(rows=rows, labels=labels, failed_rows=failed_rows, bars=bars, x_max_ms=x_max)


def _title(schedule: Schedule, job: JobSpec, title: str | None) -> str:
    failed = sorted((int(d), int(s)) for d, s in schedule.failed)
    shown = " ".join(f"[{d},{s}]" for d, s in failed[:_MAX_FAILED_IN_TITLE]) or "none"
    if len(failed) > _MAX_FAILED_IN_TITLE:
        shown += f" ... (+{len(failed) - _MAX_FAILED_IN_TITLE} more)"
    detail = (
        f"{job.name} (D={job.num_pipelines}, P={job.num_stages}, M={job.num_microbatches})"
        f"  |  failed: {shown}  |  iteration time {schedule.iteration_time_ms:.2f} ms"
    )
    if schedule.strategy:
        detail += f"  |  {schedule.strategy}"
    return f"{title}\n{detail}" if title else detail


def write_gantt(
    schedule: Schedule, job: JobSpec, path: str | Path, title: str | None = None, view: str = "auto"
) -> None:
    """Draw the Gantt chart of `schedule` at `path`: SVG when the suffix is .svg, else PNG.

    `view`: "workers" (one row per worker), "stages" (one row per stage, its peers summarized:
    planner/outputs/gantt_stages.py) or "auto" (stages above STAGE_VIEW_ABOVE workers). The title
    names the job, the failed set and the iteration time T (`title`, when given, goes above); a
    dashed line marks T on the time axis.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    view = gantt_view(job, view)
    layout = gantt_layout(schedule, job) if view == "workers" else None
    stages = stage_layout(schedule, job) if layout is None else None
    labels = layout.labels if layout else stages.labels if stages else []
    num_rows = max(1, len(labels))
    if stages:
        row_inch, label_size = 0.42, 8.0
    else:
        row_inch = 0.22 if num_rows <= 32 else 0.14 if num_rows <= 96 else 0.105
        label_size = 8.0 if num_rows <= 32 else 6.0 if num_rows <= 96 else 4.5
    x_end = layout.x_max_ms if layout else stages.x_max_ms if stages else 0.0
    x_max = max(x_end, schedule.iteration_time_ms, 1e-9) if x_end > 0 else 1.0

    # Fixed margins in inches (tight_layout would cost a full text-layout pass on 256 labels).
    label_chars = max((len(lb) for lb in labels), default=5)
    heading = _title(schedule, job, title)
    left, right = 0.45 + label_chars * label_size * 0.62 / 72, 1.4
    top, bottom = 0.25 + 0.17 * (heading.count("\n") + 1), 0.6
    width, height = 14.0, min(40.0, top + bottom + 0.3 + num_rows * row_inch)
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(
        left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height
    )
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xlim(0.0, x_max * 1.01)
    ax.set_ylim(num_rows - 0.5, -0.5)
    row_pt = (height - top - bottom) * 72 / num_rows
    stride = max(1, math.ceil(label_size * 1.15 / row_pt))
    if layout:
        _draw_worker_rows(ax, schedule, layout, min_ms=x_max * 0.3 / (width - left - right))
        present = {op for op, _ in layout.bars}
        rerouted, failed = any(rr for _, rr in layout.bars), bool(layout.failed_rows)
        _draw_row_labels(ax, layout.labels, set(layout.failed_rows), label_size, stride)
        ax.set_ylabel("worker [pipeline, stage]", fontsize=7)
    elif stages:
        draw_stage_rows(ax, stages, OP_COLOURS, _FAILED_GREY, _BAR_HEIGHT)
        present = {op for by_op in stages.steps for op in by_op}
        rerouted, failed = False, any(stages.failed)
        _draw_row_labels(ax, stages.labels, set(), label_size, stride)
        ax.set_ylabel(f"stage: height = peers busy (of {job.num_pipelines})", fontsize=7)
    _mark_iteration_time(ax, schedule.iteration_time_ms)
    ax.set_xlabel(
        "time from the start of the first iteration (ms); dashed line: iteration time T, "
        "the period at which later iterations repeat",
        fontsize=8,
    )
    ax.yaxis.set_label_coords(-(left - 0.12) / (width - left - right), 0.5)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_axisbelow(True)
    # A figure title, not ax.set_title: the latter measures every row label to place itself.
    fig.suptitle(heading, fontsize=9, y=1 - 0.1 / height, va="top")
    _draw_legend(ax, present, rerouted, failed)
    if Path(path).suffix.lower() == ".svg":
        from matplotlib import rc_context

        with rc_context({"svg.fonttype": "none"}):  # text stays text: searchable, smaller
            fig.savefig(str(path), format="svg")
    else:
        fig.savefig(str(path), format="png")
    logger.info("wrote Gantt chart (%s view, %d rows) to %s", view, num_rows, path)


def _draw_worker_rows(ax: Axes, schedule: Schedule, layout: GanttLayout, min_ms: float) -> None:
    """One bar per action, one compound path per (op, re-routed); failed rows greyed and crossed."""
    from matplotlib.patches import PathPatch

    x_max = ax.get_xlim()[1]
    num_bars = sum(len(v) for v in layout.bars.values())
    if layout.failed_rows:
        failed_spans = [(r, 0.0, x_max) for r in layout.failed_rows]
        _add_bars(
            ax,
            PathPatch(
                _bars_path(failed_spans), facecolor=_FAILED_GREY, edgecolor="#7F7F7F", hatch="xx", lw=0.4
            ),
        )
    for op in _OP_ORDER:
        for rerouted in (False, True):
            spans = layout.bars.get((op, rerouted))
            if not spans:
                continue
            _add_bars(
                ax,
                PathPatch(
                    _bars_path(spans),
                    facecolor=OP_COLOURS[op],
                    edgecolor="black" if rerouted else "white",
                    linewidth=0.6 if rerouted else (0.3 if num_bars <= 2000 else 0.0),
                    hatch="////" if rerouted else None,
                ),
            )
    if num_bars <= _MAX_BAR_LABELS:
        _label_bars(ax, schedule, layout, min_ms=min_ms)
    _draw_stage_separators(ax, layout)


def _mark_iteration_time(ax: Axes, t_ms: float) -> None:
    """A dashed vertical line at T and a bold "T = ..." tick label (nearby ticks dropped)."""
    if t_ms <= 0:
        return
    ax.axvline(t_ms, color="black", linestyle="--", linewidth=1.0, zorder=5)
    lo, hi = ax.get_xlim()
    ticks = [x for x in ax.get_xticks() if lo <= x <= hi and abs(x - t_ms) > 0.08 * (hi - lo)]
    labels = [f"{x:g}" for x in ticks] + [f"T = {t_ms:.1f}"]
    ax.set_xticks([*ticks, t_ms], labels)
    ax.tick_params(axis="x", labelsize=7)
    ax.get_xticklabels()[-1].set_fontweight("bold")


def _draw_legend(ax: Axes, present: set[str], rerouted: bool, failed: bool) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Patch | Line2D] = [
        Patch(facecolor=OP_COLOURS[op], label=op) for op in _OP_ORDER if op in present
    ]
    if rerouted:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="re-routed"))
    if failed:
        handles.append(Patch(facecolor=_FAILED_GREY, edgecolor="#7F7F7F", hatch="xx", label="failed"))
    handles.append(Line2D([], [], color="black", linestyle="--", label="iteration time T"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)


def _add_bars(ax: Axes, patch: Artist) -> None:
    # add_artist, not add_patch: add_patch walks every Bezier segment to update the data limits,
    # which costs seconds on 50k bars; the limits are set explicitly instead.
    ax.add_artist(patch)


def _bars_path(spans: list[tuple[int, float, float]]) -> MplPath:
    """One compound path of all (row, start_ms, duration_ms) rectangles: one artist per colour."""
    import numpy as np
    from matplotlib.path import Path as MplPath

    arr = np.asarray(spans, dtype=float).reshape(-1, 3)
    row, x0, x1 = arr[:, 0], arr[:, 1], arr[:, 1] + arr[:, 2]
    y0, y1 = row - _BAR_HEIGHT / 2, row + _BAR_HEIGHT / 2
    xs = np.stack([x0, x1, x1, x0, x0], axis=1)
    ys = np.stack([y0, y0, y1, y1, y0], axis=1)
    verts = np.stack([xs, ys], axis=2).reshape(-1, 2)
    one = [MplPath.MOVETO, MplPath.LINETO, MplPath.LINETO, MplPath.LINETO, MplPath.CLOSEPOLY]
    codes = np.tile(np.asarray(one, dtype=MplPath.code_type), len(arr))
    return MplPath(verts, codes)


def _label_bars(ax: Axes, schedule: Schedule, layout: GanttLayout, min_ms: float) -> None:
    """Write "d,m" inside bars wide enough to hold it (small schedules only)."""
    row_of = {w: i for i, w in enumerate(layout.rows)}
    for ws in schedule.workers:
        row = row_of[(int(ws.worker[0]), int(ws.worker[1]))]
        for a in ws.actions:
            if a.mb is not None and a.end_ms - a.start_ms >= min_ms:
                mid = (a.start_ms + a.end_ms) / 2
                ax.text(mid, row, f"{a.mb[0]},{a.mb[1]}", ha="center", va="center", fontsize=6, color="white")


def _draw_row_labels(ax: Axes, labels: list[str], failed_rows: set[int], size: float, stride: int) -> None:
    """Row labels as plain texts left of the axes (y ticks cost a Tick object per row).

    Past ~350 rows the height cap makes rows thinner than a label: then every `stride`-th row
    and every failed row is labelled.
    """
    from matplotlib.transforms import blended_transform_factory

    ax.set_yticks([])
    to_data = blended_transform_factory(ax.transAxes, ax.transData)
    for row, label in enumerate(labels):
        if row % stride and row not in failed_rows:
            continue
        colour = "#A0A0A0" if row in failed_rows else "black"
        ax.text(-0.004, row, label, transform=to_data, ha="right", va="center", fontsize=size, color=colour)


def _draw_stage_separators(ax: Axes, layout: GanttLayout) -> None:
    """Thin horizontal lines between stages, so the peer groups read as blocks."""
    for i in range(1, len(layout.rows)):
        if layout.rows[i][1] != layout.rows[i - 1][1]:
            ax.axhline(i - 0.5, color="#404040", linewidth=0.5)
