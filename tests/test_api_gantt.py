"""The job page's SVG Gantt chart: failed workers as crossed rows, stage separators, round ticks,
meaningful tooltips; and the page's live-update script long-polls without a heartbeat."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import timedelta
from typing import Any

import pytest

from api.gantt_svg import gantt_svg, tick_step, ticks
from planner.contract import FailureScenario
from planner.plan import plan
from tests.jobs import uniform_job

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def schedule() -> dict[str, Any]:
    job = uniform_job(3, 3, 4, optimizer_ms=0.5)
    result = plan(job, FailureScenario(failed=[(1, 1)]), time_limit=timedelta(seconds=1), use_cpsat=False)
    doc: dict[str, Any] = result.schedule.model_dump(mode="json", exclude_none=True)
    return doc


@pytest.mark.parametrize(
    ("span", "step"), [(960.1, 200.0), (1.0, 0.2), (0.37, 0.1), (52.0, 10.0), (7.3, 2.0), (12e3, 2000.0)]
)
def test_tick_steps_are_1_2_5(span: float, step: float) -> None:
    assert tick_step(span) == pytest.approx(step)
    labels = [label for _, label in ticks(span)]
    assert labels[0] in ("0", "0.0", "0.00") and 3 <= len(labels) <= 11
    assert all(re.fullmatch(r"\d+(\.\d+)?", x) for x in labels)
    mantissas = {float(x) / step for x in labels}
    assert all(abs(m - round(m)) < 1e-6 for m in mantissas)  # multiples of the step, no float noise


def test_no_odd_tick_labels() -> None:
    labels = [label for _, label in ticks(960.1)]
    assert labels == ["0", "200", "400", "600", "800"]


def test_failed_worker_is_a_crossed_row(schedule: dict[str, Any]) -> None:
    svg = gantt_svg(schedule)
    root = ET.fromstring(svg)  # well-formed XML
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "[1,1] failed" in texts
    rows = [t for t in texts if t and re.fullmatch(r"\[\d,\d\]( failed)?", t)]
    assert len(rows) == 9  # 3 x 3 workers: the failed one keeps its row
    assert rows == sorted(rows, key=lambda t: (t[3], t[1]))  # by stage, then pipeline
    failed = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "failed-row"]
    assert len(failed) == 1 and failed[0].get("fill") == "url(#recycle-failed)"
    assert root.find(f".//{SVG}pattern[@id='recycle-failed']") is not None


def test_stage_separators(schedule: dict[str, Any]) -> None:
    root = ET.fromstring(gantt_svg(schedule))
    seps = [ln for ln in root.iter(f"{SVG}line") if ln.get("class") == "stage-sep"]
    assert len(seps) == 2  # between stages 0|1 and 1|2


def test_tooltips_say_what_a_bar_is(schedule: dict[str, Any]) -> None:
    svg = gantt_svg(schedule)
    assert "None" not in svg
    titles = [t.text or "" for t in ET.fromstring(svg).iter(f"{SVG}title")]
    assert any(t.startswith("OPT stage 2 on [0,2]: gradient all-reduce") for t in titles)
    assert any(re.match(r"F micro-batch \[0,0\] at stage 0 on \[0,0\], 0\.00-", t) for t in titles)
    rerouted = [t for t in titles if "re-routed" in t]
    assert rerouted and all(" at stage 1 on [" in t and "[1,1] failed" in t for t in rerouted)


def test_iteration_time_marked_and_ticks_round(schedule: dict[str, Any]) -> None:
    root = ET.fromstring(gantt_svg(schedule))
    marks = [ln for ln in root.iter(f"{SVG}line") if ln.get("class") == "iteration-time"]
    assert len(marks) == 1
    labels = [t.text for t in root.iter(f"{SVG}text") if t.text and re.fullmatch(r"[\d.]+", t.text)]
    step = float(labels[1]) - float(labels[0])
    assert step in (1.0, 2.0, 5.0, 10.0, 20.0, 50.0)


def test_empty_and_failure_free() -> None:
    assert "<svg" in gantt_svg({"workers": [], "iteration_time_ms": 0.0})
    doc = {"workers": [{"worker": [0, 0], "actions": [{"op": "OPT", "start_ms": 0.0, "end_ms": 1.0}]}]}
    svg = gantt_svg({**doc, "iteration_time_ms": 1.0, "failed": []})
    assert "failed" not in svg.replace("recycle-failed", "") and "stage-sep" not in svg
