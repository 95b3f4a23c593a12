"""Per-stage Gantt view, the iteration-time marker, SVG output, and aligned tables (simulate)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from planner.outputs import gantt_view, render_table, stage_layout, write_gantt
from tests.jobs import uniform_job
from tests.test_outputs import PNG_MAGIC, make_job, make_schedule
from whatif.events import RunFigures
from whatif.table import render_runs


def test_stage_layout_counts_busy_peers_per_op() -> None:
    layout = stage_layout(make_schedule(), make_job())
    assert layout.alive == [2, 1] and layout.failed == [0, 1]
    assert layout.labels == ["stage 0: 2/2 alive", "stage 1: 1/2 alive"]
    times, counts = layout.steps[0]["F"]
    # Both stage-0 workers run F 0..1 and 1..2: two peers busy from 0 to 2, none after.
    assert times == [0.0, 2.0] and counts == [2, 0]
    assert layout.steps[1]["BW"] == ([2.1, 4.1, 5.1, 7.1, 8.1, 10.1, 11.1, 13.1], [1, 0, 1, 0, 1, 0, 1, 0])
    assert layout.x_max_ms == pytest.approx(16.2)


def test_auto_view_switches_to_stages_above_64_workers() -> None:
    assert gantt_view(uniform_job(8, 8, 2), "auto") == "workers"
    assert gantt_view(uniform_job(9, 8, 2), "auto") == "stages"
    assert gantt_view(uniform_job(16, 16, 2), "workers") == "workers"
    with pytest.raises(ValueError, match="view"):
        gantt_view(make_job(), "pipelines")


@pytest.mark.parametrize("view", ["workers", "stages"])
def test_gantt_marks_iteration_time_in_both_views(tmp_path: Path, view: str) -> None:
    svg = tmp_path / "g.svg"
    write_gantt(make_schedule(), make_job(), svg, view=view)
    text = svg.read_text()
    assert "<svg" in text and "T = 16.2" in text and "iteration time T" in text
    png = tmp_path / "g.png"
    write_gantt(make_schedule(), make_job(), png, view=view)
    assert png.read_bytes()[:8] == PNG_MAGIC
    if view == "stages":
        assert "stage 1: 1/2 alive" in text


def _spans(dash_line: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"-+", dash_line)]


def test_render_table_align_override() -> None:
    lines = render_table(["name", "pct"], [["a", "9.5%"], ["bb", "100.0%"]], align="lr").split("\n")
    assert lines[2].endswith("  9.5%") and lines[3].endswith("100.0%")
    with pytest.raises(ValueError, match="align"):
        render_table(["a", "b"], [[1, 2]], align="l")


def test_simulate_table_columns_line_up() -> None:
    runs = {
        "recycle": RunFigures(
            "recycle", samples=31_410_000.0, effective_throughput=363.49, retained_vs_1f1b=1.304
        ),
        "checkpoint-restart": RunFigures(
            "checkpoint-restart",
            samples=9_500_000.0,
            effective_throughput=11.5,
            retained_vs_1f1b=0.476,
            recovery_s=19800.0,
            checkpoint_fallbacks=35,
        ),
        "bamboo": RunFigures("bamboo", samples=100.0, effective_throughput=0.5, retained_vs_1f1b=0.05),
    }
    lines = render_runs(runs).split("\n")
    head, dashes, body = lines[0], lines[1], lines[2:5]
    spans = _spans(dashes)
    assert len(spans) == 10
    assert [head[a:b].strip() for a, b in spans][:4] == ["strategy", "samples", "samples/s", "vs 1F1B"]
    for line in body:
        assert line == line.rstrip()
        cells = [line[a:b] for a, b in spans]
        # Every number column is right-aligned: its cells end exactly where the column ends.
        for cell in cells[1:]:
            assert cell == cell.rstrip() and cell.strip(), (line, cells)
    assert body[0][slice(*spans[1])].strip() == "31,410,000"
    assert body[1][slice(*spans[3])].strip() == "47.6%"
    assert any(line.startswith("GPU-hours") for line in lines)
