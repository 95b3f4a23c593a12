"""The launch's loss curve PNG (runtime_adapter/loss_plot.py): a valid image, one marker per event."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime_adapter.loss_plot import draw_loss, markers, write_loss_png
from runtime_adapter.summary import LaunchEvent

pytestmark = pytest.mark.timeout(60)

LOSSES = [(it, 4.4 - 0.05 * it) for it in range(10)]
EVENTS = [
    LaunchEvent(t=10.0, kind="died", worker=(1, 1), version_before=1, iteration=3, code=-9),
    LaunchEvent(t=20.0, kind="rejoin", worker=(1, 1), version_before=2),  # iteration None
    LaunchEvent(t=30.0, kind="restore", worker=None, version_before=3, checkpoint=4, why="stage lost"),
    LaunchEvent(t=0.5, kind="died", worker=(0, 0), version_before=1, code=1),  # before its first step
]


def test_markers_placed_by_iteration_then_time_then_start() -> None:
    times = {it: 2.0 * it + 1.0 for it in range(10)}  # iteration it's loss known at 2 it + 1
    got = markers(LOSSES, EVENTS, times)
    assert [(m.iteration, m.kind) for m in got] == [(3, "died"), (10, "rejoin"), (10, "restore"), (0, "died")]
    assert got[0].label == "worker [1, 1] died" and got[1].label == "worker [1, 1] re-joined"
    assert got[2].label == "restore from iteration 4"
    times = {it: float(it) * 5 for it in range(10)}
    assert [m.iteration for m in markers(LOSSES, EVENTS, times)] == [3, 4, 6, 1]
    # no times: events without an iteration go at the start
    assert [m.iteration for m in markers(LOSSES, EVENTS)] == [3, 0, 0, 0]
    assert [m.iteration for m in markers([], EVENTS[1:2])] == [0]


def test_figure_has_one_vertical_line_and_legend_entry_per_event() -> None:
    fig = draw_loss(LOSSES, EVENTS, title="gpt-d2p2m2")
    (ax,) = fig.axes
    vertical = [ln for ln in ax.get_lines() if len(set(ln.get_xdata())) == 1 and len(ln.get_xdata()) == 2]
    assert sorted(float(ln.get_xdata()[0]) for ln in vertical) == [0, 0, 0, 3]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0] == "loss" and "worker [1, 1] died (iteration 3)" in labels and len(labels) == 5
    assert ax.get_title() == "gpt-d2p2m2"


def test_png_written_and_readable(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    path = write_loss_png(tmp_path / "sub" / "loss.png", LOSSES, EVENTS, title="job")
    assert path == tmp_path / "sub" / "loss.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(str(path))
    assert img.shape[0] > 100 and img.shape[1] > 100
    # no losses at all, no events, no title: still an image
    empty = write_loss_png(tmp_path / "empty.png", [], [])
    assert mpimg.imread(str(empty)).shape[0] > 100
