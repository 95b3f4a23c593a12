"""The end-of-run summary of `recycle launch`: iterations, failures, recoveries, restores.

Pure data in, lines out (no torch), so it is unit-tested on hand-made events. The launcher records
a `LaunchEvent` for every death, re-join and restore (launch.py); the progress monitor (progress.py)
records when it first saw a step of each schedule version. A recovery's time is from the launcher
noticing the event to the first iteration stepped under a newer schedule version, as seen in the
accounting files (it includes that iteration and the supervision tick, ~20 ms).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime_adapter.assignment import Worker

RECOVERED = "training again after {:.2f} s"  # the summary's recovery phrase (parsed by recovery_times)
_RECOVERED_RE = re.compile(r"training again after ([0-9]+(?:\.[0-9]+)?) s")


@dataclass(frozen=True)
class LaunchEvent:
    """Something the launcher did or saw (monotonic time `t`).

    kind: "died" (a worker exited non-zero; `iteration` is the one it was running, `code` its exit
    code), "rejoin" (a worker came back), "restore" (every worker takes a restore epoch: the ones not
    running, `restarted`, are started again, the others load in place; `checkpoint` is the stepped
    count of the checkpoint they restore, None: from scratch; `why` the reason).
    `version_before` is the newest schedule version when it happened."""

    t: float
    kind: str
    worker: Worker | None
    version_before: int
    iteration: int | None = None
    code: int | None = None
    checkpoint: int | None = None
    why: str = ""
    restarted: tuple[Worker, ...] = ()


def recovery_s(event: LaunchEvent, version_seen: dict[int, float]) -> float | None:
    """Seconds from `event` to the first step under a version newer than `event.version_before`
    (None: no such step was seen)."""
    after = [t for v, t in version_seen.items() if v > event.version_before and t >= event.t]
    return min(after) - event.t if after else None


def _took(event: LaunchEvent, version_seen: dict[int, float]) -> str:
    took = recovery_s(event, version_seen)
    return "no iteration stepped after it" if took is None else RECOVERED.format(took)


def recovery_times(text: str) -> list[float]:
    """The recovery times (s) a launch's printed summary reports, in order (bench/gpu_check.py)."""
    return [float(m.group(1)) for m in _RECOVERED_RE.finditer(text)]


def event_label(event: LaunchEvent) -> str:
    """A short name of `event`: "worker [1, 1] died", "worker [1, 1] re-joined", "restore from
    iteration 4" (the loss plot's legend)."""
    who = f"worker {list(event.worker)}" if event.worker is not None else "every worker"
    if event.kind == "died":
        return f"{who} died"
    if event.kind == "rejoin":
        return f"{who} re-joined"
    start = "scratch" if event.checkpoint is None else f"iteration {event.checkpoint}"
    return f"restore from {start}"


def event_line(event: LaunchEvent, died_note: str) -> str:
    """The line `recycle launch` and `recycle agent` print for `event` as it happens; `died_note` ends
    a death's line (where the death went: the new schedule version, the job it was reported to)."""
    who = list(event.worker) if event.worker is not None else "every worker"
    if event.kind == "died":
        where = "before its first step" if event.iteration is None else f"in iteration {event.iteration}"
        return f"worker {who} died {where} (exit {event.code}); {died_note}"
    if event.kind == "rejoin":
        return f"worker {who} re-joins"
    start = "iteration 0" if event.checkpoint is None else f"the checkpoint at iteration {event.checkpoint}"
    return f"{event.why}: restore from {start}, {restarted(event)}"


def restarted(event: LaunchEvent) -> str:
    """Which workers a restore restarted: "restarting [0, 1], [1, 1]" or "no process restarted"."""
    if not event.restarted:
        return "no process restarted"
    return "restarting " + ", ".join(str(list(w)) for w in event.restarted)


def summarize(
    events: list[LaunchEvent],
    version_seen: dict[int, float],
    stepped: int,
    target: int,
    final_version: int,
    last_loss: tuple[int, float] | None = None,
) -> list[str]:
    """The summary lines. `stepped`: iterations every alive worker stepped; `last_loss`: (iteration,
    loss) of the last iteration whose loss is known."""
    head = f"summary: {stepped}/{target} iterations, last schedule v{final_version}"
    if last_loss is not None:
        head += f", loss {last_loss[1]:.4f} at iteration {last_loss[0]}"
    lines = [head]
    deaths = [e for e in events if e.kind == "died"]
    restores = [e for e in events if e.kind == "restore"]
    rejoins = [e for e in events if e.kind == "rejoin"]
    lines.append(f"  failures: {len(deaths) or 'none'}")
    for e in deaths:
        assert e.worker is not None
        where = "before its first step" if e.iteration is None else f"in iteration {e.iteration}"
        lines.append(
            f"    worker {list(e.worker)} died {where} (exit {e.code}) under v{e.version_before}: "
            f"{_took(e, version_seen)}"
        )
    if rejoins:
        who = ", ".join(str(list(e.worker)) for e in rejoins if e.worker is not None)
        lines.append(f"  re-joins: {len(rejoins)} ({who})")
    lines.append(f"  restores from a checkpoint: {len(restores) or 'none'}")
    for e in restores:
        start = (
            "from scratch (no complete checkpoint)"
            if e.checkpoint is None
            else f"from iteration {e.checkpoint}"
        )
        lines.append(f"    {e.why}: restored {start}, {restarted(e)}: {_took(e, version_seen)}")
    return lines
