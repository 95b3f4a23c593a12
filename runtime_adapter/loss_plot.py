"""The loss curve of a launch (`<out>/loss.png`): loss per iteration, with a vertical marker at every
failure, re-join and restore the launcher recorded (summary.LaunchEvent).

A marker goes at the event's `iteration`. Re-joins, restores and deaths before a first step carry
none: they go at the iteration in flight at the event's time when `times` (iteration -> monotonic time
its loss was known, the clock of LaunchEvent.t) is given, else at the first iteration.

matplotlib is imported only when drawing (explicit Agg canvas, as planner/outputs/gantt.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime_adapter.summary import LaunchEvent, event_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# kind -> (colour, line style)
MARKER_STYLE: dict[str, tuple[str, str]] = {
    "died": ("#D6404E", "--"),
    "rejoin": ("#54A24B", ":"),
    "restore": ("#4C78A8", "-."),
}


@dataclass(frozen=True)
class Marker:
    """A vertical line of the plot: at `iteration`, one legend entry `label`."""

    iteration: int
    kind: str
    label: str


def markers(
    losses: Sequence[tuple[int, float]],
    events: Sequence[LaunchEvent],
    times: Mapping[int, float] | None = None,
) -> list[Marker]:
    """Where each event goes (see the module docstring); pure, no matplotlib."""
    its = sorted(it for it, _ in losses)
    start = its[0] if its else 0
    out = []
    for e in events:
        at = e.iteration
        if at is None and times:
            later = [it for it in its if it in times and times[it] >= e.t]
            at = later[0] if later else (its[-1] + 1 if its else start)
        out.append(Marker(start if at is None else at, e.kind, event_label(e)))
    return out


def draw_loss(
    losses: Sequence[tuple[int, float]],
    events: Sequence[LaunchEvent],
    title: str | None = None,
    times: Mapping[int, float] | None = None,
) -> Figure:
    """The figure (not written): the loss line and one vertical line per marker."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    pts = sorted(losses)
    ax.plot([it for it, _ in pts], [x for _, x in pts], color="black", lw=1.2, marker=".", ms=4, label="loss")
    for m in markers(pts, events, times):
        colour, style = MARKER_STYLE.get(m.kind, ("#7F7F7F", "-"))
        ax.axvline(
            m.iteration, color=colour, linestyle=style, lw=1.0, label=f"{m.label} (iteration {m.iteration})"
        )
    ax.set_xlabel("iteration", fontsize=8)
    ax.set_ylabel("loss", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(linewidth=0.3, alpha=0.5)
    ax.legend(loc="best", fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def write_loss_png(
    path: Path,
    losses: list[tuple[int, float]],
    events: list[LaunchEvent],
    title: str | None = None,
    times: Mapping[int, float] | None = None,
) -> Path:
    """Draw the loss curve with its event markers to the PNG `path` (directories created); `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    draw_loss(losses, events, title, times).savefig(str(path), format="png")
    return path
