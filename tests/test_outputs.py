"""Tests of the schedule renderers: Gantt PNG, Chrome trace, plain-text and markdown tables."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from planner.contract import JobSpec, Schedule
from planner.outputs import (
    gantt_layout,
    render_key_values,
    render_table,
    to_chrome_trace,
    write_chrome_trace,
    write_gantt,
)
from planner.outputs.gantt import OP_COLOURS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# D=2, P=2, M=2 with worker [1,1] failed: [0,1] hosts every micro-batch at stage 1, so its actions
# on micro-batches [1, m] are re-routed. Rows: (op, d, m, start_ms, end_ms); d = m = None for OPT.
ORDERS: dict[tuple[int, int], list[tuple[str, int | None, int | None, float, float]]] = {
    (0, 0): [
        ("F", 0, 0, 0.0, 1.0),
        ("F", 0, 1, 1.0, 2.0),
        ("B", 0, 0, 4.2, 5.2),
        ("W", 0, 0, 5.2, 6.2),
        ("B", 0, 1, 10.2, 11.2),
        ("W", 0, 1, 11.2, 12.2),
        ("OPT", None, None, 14.0, 14.5),
    ],
    (1, 0): [
        ("F", 1, 0, 0.0, 1.0),
        ("F", 1, 1, 1.0, 2.0),
        ("B", 1, 0, 7.3, 8.3),
        ("W", 1, 0, 8.3, 9.3),
        ("B", 1, 1, 13.3, 14.3),
        ("W", 1, 1, 14.3, 15.3),
        ("OPT", None, None, 15.7, 16.2),
    ],
    (0, 1): [
        ("F", 0, 0, 1.1, 2.1),
        ("BW", 0, 0, 2.1, 4.1),
        ("F", 1, 0, 4.1, 5.1),
        ("BW", 1, 0, 5.1, 7.1),
        ("F", 0, 1, 7.1, 8.1),
        ("BW", 0, 1, 8.1, 10.1),
        ("F", 1, 1, 10.1, 11.1),
        ("BW", 1, 1, 11.1, 13.1),
        ("OPT", None, None, 13.1, 13.6),
    ],
}
NUM_ACTIONS = sum(len(v) for v in ORDERS.values())
REROUTED = {((0, 1), "F", (1, 0)), ((0, 1), "BW", (1, 0)), ((0, 1), "F", (1, 1)), ((0, 1), "BW", (1, 1))}


def make_job() -> JobSpec:
    stage = {
        "forward": 1.0,
        "backward_input": 1.0,
        "backward_weight": 1.0,
        "optimizer": 0.5,
        "activation_mib": 10.0,
        "weight_grad_mib": 5.0,
    }
    return JobSpec.model_validate(
        {
            "name": "tiny",
            "num_pipelines": 2,
            "num_stages": 2,
            "num_microbatches": 2,
            "stages": [stage, stage],
            "comm": {"activation_ms": 0.1, "cross_pipeline_ms": 0.2, "allreduce_ms": 0.3},
        }
    )


def make_schedule(worker_order: list[tuple[int, int]] | None = None) -> Schedule:
    workers = []
    for w in worker_order or list(ORDERS):
        actions = [
            {"op": op, "start_ms": t0, "end_ms": t1} | ({} if d is None else {"mb": [d, m]})
            for op, d, m, t0, t1 in ORDERS[w]
        ]
        workers.append({"worker": list(w), "actions": actions})
    return Schedule.model_validate(
        {"job": "tiny", "failed": [[1, 1]], "iteration_time_ms": 16.2, "workers": workers}
    )


# ---------------------------------------------------------------- Gantt


def test_importing_outputs_loads_neither_matplotlib_nor_ortools() -> None:
    code = (
        "import sys, planner.outputs; "
        "bad = [m for m in ('matplotlib', 'ortools', 'planner.problem') if m in sys.modules]; "
        "sys.exit(str(bad) if bad else 0)"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_gantt_layout_orders_rows_by_stage_then_pipeline_and_keeps_failed_row() -> None:
    layout = gantt_layout(make_schedule(), make_job())
    assert layout.rows == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert layout.labels == ["[0,0]", "[1,0]", "[0,1]", "[1,1] failed"]
    assert layout.failed_rows == [3]
    assert sum(len(v) for v in layout.bars.values()) == NUM_ACTIONS
    rerouted = sorted(
        (op, row, start) for (op, rr), spans in layout.bars.items() if rr for row, start, _ in spans
    )
    assert rerouted == [("BW", 2, 5.1), ("BW", 2, 11.1), ("F", 2, 4.1), ("F", 2, 10.1)]
    assert layout.x_max_ms == pytest.approx(16.2)


def test_write_gantt_writes_a_legible_png(tmp_path: Path) -> None:
    path = tmp_path / "tiny.png"
    write_gantt(make_schedule(), make_job(), path, title="tiny test")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    with Image.open(path) as img:
        width, height = img.size
        assert width >= 800 and height >= 200
        counts = img.convert("RGB").getcolors(maxcolors=1 << 22) or []
        colours = {tuple(c) for _, c in counts if isinstance(c, tuple)}
    assert len(colours) > 20
    # Bar interiors are painted with the exact op colours, and the failed row with its grey.
    for op in ("F", "B", "W", "BW", "OPT"):
        assert _rgb(OP_COLOURS[op]) in colours, op
    assert _rgb("#D9D9D9") in colours


def test_write_gantt_accepts_str_path_and_all_alive_schedule(tmp_path: Path) -> None:
    sched = make_schedule().model_copy(update={"failed": []})
    sched.workers = [w for w in sched.workers if tuple(w.worker) != (0, 1)]
    path = str(tmp_path / "alive.png")
    write_gantt(sched, make_job(), path)
    assert Path(path).read_bytes()[:8] == PNG_MAGIC


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


# ---------------------------------------------------------------- Chrome trace


def test_chrome_trace_has_one_complete_event_per_action() -> None:
    trace = to_chrome_trace(make_schedule(), make_job())
    assert trace["displayTimeUnit"] == "ms"
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == NUM_ACTIONS
    expected: dict[tuple[object, ...], tuple[float, float]] = {
        (w, op, (d, m)) if d is not None else (w, op, None): (t0, t1)
        for w, rows in ORDERS.items()
        for op, d, m, t0, t1 in rows
    }
    seen = set()
    for e in events:
        d, s = e["tid"], e["pid"]
        assert e["args"]["worker"] == [d, s]
        mb = None if e["args"]["mb"] is None else tuple(e["args"]["mb"])
        key = ((d, s), e["cat"], mb)
        t0, t1 = expected[key]
        assert e["ts"] == pytest.approx(t0 * 1000.0)
        assert e["dur"] == pytest.approx((t1 - t0) * 1000.0)
        assert e["args"]["rerouted"] == (key in REROUTED)
        assert e["name"] == (e["cat"] if mb is None else f"{e['cat']} {mb[0]},{mb[1]}")
        seen.add(key)
    assert seen == set(expected)
    assert sum(e["args"]["rerouted"] for e in events) == len(REROUTED)


def test_chrome_trace_metadata_names_stages_and_workers() -> None:
    trace = to_chrome_trace(make_schedule(), make_job())
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    sort_index = {
        (e["pid"], e["tid"]): e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"
    }
    assert processes == {0: "stage 0", 1: "stage 1"}
    assert threads == {
        (0, 0): "worker [0,0]",
        (0, 1): "worker [1,0]",
        (1, 0): "worker [0,1]",
        (1, 1): "worker [1,1] failed",
    }
    assert sort_index == {(s, d): d for s, d in threads}
    assert trace["otherData"]["failed"] == [[1, 1]]
    assert trace["otherData"]["iteration_time_ms"] == 16.2
    assert trace["otherData"]["job"] == "tiny"


def test_chrome_trace_is_json_and_deterministic(tmp_path: Path) -> None:
    job = make_job()
    trace = to_chrome_trace(make_schedule(), job)
    assert json.loads(json.dumps(trace)) == trace
    shuffled = make_schedule(worker_order=[(0, 1), (1, 0), (0, 0)])
    assert to_chrome_trace(shuffled, job) == trace
    path = tmp_path / "trace.json"
    write_chrome_trace(make_schedule(), job, path)
    assert json.loads(path.read_text()) == trace
    first = path.read_bytes()
    write_chrome_trace(shuffled, job, path)
    assert path.read_bytes() == first


# ---------------------------------------------------------------- tables


def _column_spans(dash_line: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"-+", dash_line)]


def test_render_table_aligns_columns() -> None:
    text = render_table(
        ["strategy", "iteration ms", "workers"],
        [["recycle", 52.0, 16], ["adaptive-1f1b", 61.12345, 15], ["none", None, 4]],
    )
    lines = text.split("\n")
    assert lines[0].startswith("strategy")
    spans = _column_spans(lines[1])
    assert len(spans) == 3
    assert [lines[2][a:b].strip() for a, b in spans] == ["recycle", "52.000", "16"]
    assert [lines[3][a:b].strip() for a, b in spans] == ["adaptive-1f1b", "61.123", "15"]
    assert [lines[4][a:b].strip() for a, b in spans] == ["none", "-", "4"]
    # Numbers are right-aligned: they end where the column ends.
    assert lines[2][: spans[1][1]].endswith("52.000")
    assert lines[3][: spans[2][1]].endswith("15")


def test_render_table_markdown_has_header_separator() -> None:
    text = render_table(["a", "ms"], [["x|y", 1.5], ["z", 2.25]], markdown=True)
    lines = text.split("\n")
    assert len(lines) == 4
    assert re.fullmatch(r"\| -{3,} \| -{2,}: \|", lines[1])
    assert lines[2] == "| x\\|y | 1.500 |"
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines)
    assert len({len(line) for line in lines}) == 1


def test_render_table_rejects_ragged_rows() -> None:
    with pytest.raises(ValueError, match=r"rows\[1\]"):
        render_table(["a", "b"], [[1, 2], [3]])


CELL_TEXT = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)
CELL = st.one_of(CELL_TEXT, st.integers(-(10**6), 10**6), st.none())


@settings(max_examples=60, deadline=None)
@given(
    headers=st.lists(CELL_TEXT, min_size=1, max_size=5),
    data=st.data(),
)
def test_render_table_every_cell_sits_in_its_column(headers: list[str], data: st.DataObject) -> None:
    rows = data.draw(st.lists(st.lists(CELL, min_size=len(headers), max_size=len(headers)), max_size=6))
    lines = render_table(headers, rows).split("\n")
    spans = _column_spans(lines[1])
    assert len(spans) == len(headers)
    assert [lines[0][a:b].strip() for a, b in spans] == headers
    for line, row in zip(lines[2:], rows, strict=True):
        assert [line[a:b].strip() for a, b in spans] == ["-" if v is None else str(v) for v in row]
    md = render_table(headers, rows, markdown=True).split("\n")
    assert len(md) == len(rows) + 2
    assert len({len(line) for line in md}) == 1


def test_render_key_values_aligns_values() -> None:
    text = render_key_values([("job", "gpt3-1.3b"), ("iteration time ms", 52.0), ("failed", "[1,2]")])
    lines = text.split("\n")
    col = lines[1].index("52.000")
    assert lines[0].index("gpt3-1.3b") == col
    assert lines[2].index("[1,2]") == col
    assert lines[0].startswith("job ")
    assert render_key_values([]) == ""
