"""An inline SVG Gantt chart of a schedule, for the human job page.

Like the planner's PNG (planner/outputs/gantt.py): one row per worker [d, s], ordered by stage then
pipeline, a line between stages, failed workers kept in their row greyed and crossed, re-routed
micro-batches outlined, the iteration time T marked, and a time axis with round tick steps
(1, 2 or 5 times a power of ten).
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

COLORS = {"F": "#4c78a8", "B": "#59a14f", "W": "#f28e2b", "BW": "#76b7b2", "OPT": "#9d9d9d"}
ROW_H, LABEL_W, WIDTH, TOP, RIGHT = 18, 92, 1100, 28, 14
FAILED_FILL = "url(#recycle-failed)"
MAX_LABELLED_ACTIONS = 20000  # above this, micro-batch numbers are left out of the bars

Worker = tuple[int, int]


def tick_step(span: float, target: int = 6) -> float:
    """The round step (1, 2 or 5 x 10^k) giving about `target` intervals over `span`."""
    if not math.isfinite(span) or span <= 0:
        return 1.0
    raw = span / target
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1.0, 2.0, 5.0, 10.0) if m * mag >= raw * (1 - 1e-9))


def ticks(end: float, target: int = 6) -> list[tuple[float, str]]:
    """(position, label) of the axis ticks 0, step, 2 step, ... up to `end`, labels without float noise."""
    step = tick_step(end, target)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    count = math.floor(end / step + 1e-9)
    return [(k * step, f"{k * step:.{decimals}f}") for k in range(count + 1)]


def _title(op: str, mb: list[int] | None, worker: Worker, start: float, end: float) -> str:
    d, s = worker
    span = f"{start:.2f}-{end:.2f} ms"
    if op == "OPT" or mb is None:
        return f"OPT stage {s} on [{d},{s}]: gradient all-reduce with its peers + optimizer step, {span}"
    text = f"{op} micro-batch [{mb[0]},{mb[1]}] at stage {s} on [{d},{s}], {span}"
    if mb[0] != d:
        text += f" (re-routed: its own worker [{mb[0]},{s}] failed)"
    return text


def _legend(parts: list[str], failed: bool) -> None:
    x = LABEL_W
    for op, color in COLORS.items():
        parts.append(f'<rect x="{x}" y="6" width="12" height="12" fill="{color}"/>')
        parts.append(f'<text x="{x + 16}" y="16">{op}</text>')
        x += 56
    parts.append(f'<rect x="{x}" y="6" width="12" height="12" fill="#fff" stroke="#222" stroke-width="1.2"/>')
    parts.append(f'<text x="{x + 16}" y="16">re-routed micro-batch</text>')
    x += 150
    if failed:
        parts.append(f'<rect x="{x}" y="6" width="12" height="12" fill="{FAILED_FILL}" stroke="#888"/>')
        parts.append(f'<text x="{x + 16}" y="16">failed worker</text>')
        x += 100
    parts.append(f'<line x1="{x}" y1="12" x2="{x + 14}" y2="12" stroke="#b00" stroke-dasharray="3,2"/>')
    parts.append(f'<text x="{x + 18}" y="16">T: iteration time</text>')


def gantt_svg(schedule: dict[str, Any]) -> str:
    """SVG markup: x is predicted time (ms) in the first iteration, rows are workers [d, s] by stage.

    Hovering a bar shows what it is (`<title>`): op, micro-batch, worker, times, re-routing.
    """
    actions: dict[Worker, list[dict[str, Any]]] = {
        (int(ws["worker"][0]), int(ws["worker"][1])): ws["actions"] for ws in schedule["workers"]
    }
    failed = {(int(d), int(s)) for d, s in schedule.get("failed", [])} - set(actions)
    rows = sorted(set(actions) | failed, key=lambda w: (w[1], w[0]))
    itime = float(schedule.get("iteration_time_ms") or 0.0)
    end = max((a["end_ms"] for acts in actions.values() for a in acts), default=0.0)
    end = max(end, itime) or 1.0
    scale = (WIDTH - LABEL_W - RIGHT) / end
    plot_bottom = TOP + ROW_H * len(rows)
    height = plot_bottom + 30
    labelled = sum(len(a) for a in actions.values()) < MAX_LABELLED_ACTIONS
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="10" class="gantt">',
        '<defs><pattern id="recycle-failed" width="8" height="8" patternUnits="userSpaceOnUse">'
        '<rect width="8" height="8" fill="#e3e3e3"/>'
        '<path d="M0,0L8,8M8,0L0,8" stroke="#9a9a9a" stroke-width="0.8"/></pattern></defs>',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
    ]
    _legend(parts, bool(failed))
    for k, (t, label) in enumerate(ticks(end)):  # grid lines first: bars paint over them
        x = LABEL_W + t * scale
        parts.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{plot_bottom}" stroke="#eee"/>')
        anchor = "start" if k == 0 else "end" if x > WIDTH - RIGHT - 20 else "middle"
        parts.append(f'<text x="{x:.1f}" y="{plot_bottom + 14}" text-anchor="{anchor}">{label}</text>')
    parts.append(f'<text x="{WIDTH - 4}" y="{plot_bottom + 26}" text-anchor="end">time (ms)</text>')
    for row, (d, s) in enumerate(rows):
        y = TOP + row * ROW_H
        if row > 0 and rows[row - 1][1] != s:  # stage separator
            parts.append(
                f'<line x1="0" y1="{y - 1}" x2="{WIDTH}" y2="{y - 1}" stroke="#555" stroke-width="1" '
                f'class="stage-sep"/>'
            )
        if (d, s) in failed:
            parts.append(f'<text x="4" y="{y + 13}" fill="#b00">[{d},{s}] failed</text>')
            title = f"[{d},{s}] failed: its micro-batches run on the alive workers of stage {s}"
            parts.append(
                f'<rect x="{LABEL_W}" y="{y + 1}" width="{end * scale:.2f}" height="{ROW_H - 3}" '
                f'fill="{FAILED_FILL}" stroke="#888" class="failed-row"><title>{escape(title)}</title></rect>'
            )
            continue
        parts.append(f'<text x="4" y="{y + 13}">[{d},{s}]</text>')
        for a in actions[(d, s)]:
            x0 = LABEL_W + a["start_ms"] * scale
            w = max((a["end_ms"] - a["start_ms"]) * scale, 0.5)
            mb = a.get("mb")
            stroke = ' stroke="#222" stroke-width="1.2"' if mb is not None and mb[0] != d else ""
            title = escape(_title(a["op"], mb, (d, s), a["start_ms"], a["end_ms"]))
            parts.append(
                f'<rect x="{x0:.2f}" y="{y + 1}" width="{w:.2f}" height="{ROW_H - 3}" '
                f'fill="{COLORS.get(a["op"], "#000")}"{stroke}><title>{title}</title></rect>'
            )
            if mb is not None and w > 14 and labelled:
                parts.append(f'<text x="{x0 + 2:.2f}" y="{y + 12}" fill="white">{mb[1]}</text>')
    if itime > 0:
        x = LABEL_W + itime * scale
        parts.append(
            f'<line x1="{x:.1f}" y1="{TOP - 2}" x2="{x:.1f}" y2="{plot_bottom}" stroke="#b00" '
            f'stroke-dasharray="4,3" class="iteration-time"><title>T = {itime:.2f} ms</title></line>'
        )
    parts.append("</svg>")
    return "".join(parts)
