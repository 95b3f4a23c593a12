"""Renderers of a schedule for people: Gantt PNG/SVG, Chrome/Perfetto trace, plain-text tables.

They read a docs/contract.md Schedule and its JobSpec only (never the solver, planner internals or the
simulator). Importing this package is cheap: matplotlib is loaded only when a Gantt chart is drawn.
"""

from __future__ import annotations

from planner.outputs.gantt import GanttLayout, gantt_layout, write_gantt
from planner.outputs.gantt_stages import StageLayout, gantt_view, stage_layout
from planner.outputs.table import format_cell, render_key_values, render_table
from planner.outputs.trace import to_chrome_trace, write_chrome_trace

__all__ = [
    "GanttLayout",
    "StageLayout",
    "format_cell",
    "gantt_layout",
    "gantt_view",
    "render_key_values",
    "render_table",
    "stage_layout",
    "to_chrome_trace",
    "write_chrome_trace",
    "write_gantt",
]
