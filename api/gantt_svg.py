"""An inline SVG Gantt chart of a schedule (one row per alive worker), for the human job page."""

from __future__ import annotations

from html import escape
from typing import Any

COLORS = {"F": "#4c78a8", "B": "#59a14f", "W": "#f28e2b", "BW": "#76b7b2", "OPT": "#9d9d9d"}
ROW_H, LABEL_W, WIDTH, TOP = 18, 64, 1100, 28


def gantt_svg(schedule: dict[str, Any]) -> str:
    """SVG markup: x is predicted time (ms) in the first iteration, rows are workers [d, s] by stage.

    Re-routed micro-batches (hosted by a peer of another pipeline) get a dark outline.
    """
    workers = sorted(schedule["workers"], key=lambda w: (w["worker"][1], w["worker"][0]))
    end = max((a["end_ms"] for w in workers for a in w["actions"]), default=1.0) or 1.0
    scale = (WIDTH - LABEL_W - 10) / end
    height = TOP + ROW_H * len(workers) + 24
    num_actions = sum(len(w["actions"]) for w in workers)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="10">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
    ]
    for i, (op, color) in enumerate(COLORS.items()):
        x = LABEL_W + i * 70
        parts.append(f'<rect x="{x}" y="6" width="12" height="12" fill="{color}"/>')
        parts.append(f'<text x="{x + 16}" y="16">{op}</text>')
    parts.append(f'<text x="{LABEL_W + 380}" y="16">dark outline: re-routed micro-batch</text>')
    for row, ws in enumerate(workers):
        d, s = ws["worker"]
        y = TOP + row * ROW_H
        parts.append(f'<text x="4" y="{y + 13}">[{d},{s}]</text>')
        for a in ws["actions"]:
            x0 = LABEL_W + a["start_ms"] * scale
            w = max((a["end_ms"] - a["start_ms"]) * scale, 0.5)
            mb = a.get("mb")
            rerouted = mb is not None and mb[0] != d
            stroke = ' stroke="#222" stroke-width="1.2"' if rerouted else ""
            title = escape(f"{a['op']} {mb} {a['start_ms']:.2f}-{a['end_ms']:.2f} ms")
            parts.append(
                f'<rect x="{x0:.2f}" y="{y + 1}" width="{w:.2f}" height="{ROW_H - 3}" '
                f'fill="{COLORS.get(a["op"], "#000")}"{stroke}><title>{title}</title></rect>'
            )
            if mb is not None and w > 14 and num_actions < 20000:
                parts.append(f'<text x="{x0 + 2:.2f}" y="{y + 12}" fill="white">{mb[1]}</text>')
    axis_y = TOP + ROW_H * len(workers) + 14
    for k in range(6):
        t = end * k / 5
        anchor = "start" if k == 0 else "end" if k == 5 else "middle"
        parts.append(
            f'<text x="{LABEL_W + t * scale:.1f}" y="{axis_y}" text-anchor="{anchor}">{t:.1f} ms</text>'
        )
    parts.append("</svg>")
    return "".join(parts)
