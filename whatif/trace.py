"""Failure/rejoin traces: parsing a CSV (errors name the line) and a seeded exponential generator.

CSV format, one event per row, optional header `time,worker,event`:

    time,worker,event
    3600,3:5,fail
    2.5h,3:5,rejoin

- time: seconds, or a number with a unit suffix s, m, h or d;
- worker: `d:s` (also accepted: `d/s`, or `"d,s"` quoted);
- event: `fail` (or failure, down) or `rejoin` (or repair, recover, up).
Rows may come in any order; they are sorted by time (ties in file order). Failing a worker that is
already down, or re-joining one that is up, is an error naming the line.
"""

from __future__ import annotations

import csv
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

from planner.contract import JobSpec
from planner.errors import InvalidInputError

FAIL, REJOIN = "fail", "rejoin"
_EVENTS = {
    "fail": FAIL,
    "failure": FAIL,
    "down": FAIL,
    "rejoin": REJOIN,
    "repair": REJOIN,
    "recover": REJOIN,
    "up": REJOIN,
}
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([smhd]?)\s*$")
_WORKER = re.compile(r"^\s*\[?\s*(\d+)\s*[:/,\s]\s*(\d+)\s*\]?\s*$")


class TraceError(InvalidInputError):
    """A trace row that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Event:
    """A worker failing or re-joining at `time_s` seconds into the run."""

    time_s: float
    worker: tuple[int, int]
    kind: str
    line: int | None = None  # line in the CSV it came from (None: generated)


def parse_duration(text: str, default_unit: str = "s") -> float:
    """Seconds in `text` ("90", "30m", "6h", "7d"); a bare number is in `default_unit`."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"not a duration: {text!r} (expected a number with optional unit s, m, h or d)")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or default_unit]
    if not math.isfinite(seconds):  # 1e400 parses as inf
        raise ValueError(f"not a duration: {text!r} (too large)")
    return seconds


def _parse_row(row: list[str], where: str, job: JobSpec) -> Event:
    if len(row) != 3:
        raise TraceError(f"{where}: expected 3 fields (time, worker, event), got {len(row)}: {row}")
    time_txt, worker_txt, event_txt = row
    try:
        time_s = parse_duration(time_txt)
    except ValueError as exc:
        raise TraceError(f"{where}: bad time: {exc}") from None
    match = _WORKER.match(worker_txt)
    if not match:
        raise TraceError(f"{where}: bad worker {worker_txt!r} (expected d:s, e.g. 3:5)")
    d, s = int(match.group(1)), int(match.group(2))
    if d >= job.num_pipelines or s >= job.num_stages:
        raise TraceError(
            f"{where}: worker [{d}, {s}] is outside the job's grid "
            f"({job.num_pipelines} pipelines x {job.num_stages} stages)"
        )
    kind = _EVENTS.get(event_txt.strip().lower())
    if kind is None:
        raise TraceError(f"{where}: unknown event {event_txt!r} (expected fail or rejoin)")
    return Event(time_s, (d, s), kind, None)


def check_events(events: list[Event], source: str = "trace") -> list[Event]:
    """Sort by time and check each event is possible (fail an alive worker, rejoin a failed one)."""
    ordered = sorted(events, key=lambda e: e.time_s)
    down: set[tuple[int, int]] = set()
    for e in ordered:
        where = f"{source} line {e.line}" if e.line is not None else f"{source} at {e.time_s:.0f} s"
        if e.kind == FAIL and e.worker in down:
            raise TraceError(f"{where}: worker {list(e.worker)} fails but is already down")
        if e.kind == REJOIN and e.worker not in down:
            raise TraceError(f"{where}: worker {list(e.worker)} re-joins but is not down")
        (down.add if e.kind == FAIL else down.discard)(e.worker)
    return ordered


def read_trace(path: str | Path, job: JobSpec) -> list[Event]:
    """Events of a CSV trace, sorted and checked; TraceError names the offending line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"trace {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8 CSV") from None
    events = []
    for lineno, row in enumerate(csv.reader(text.splitlines()), start=1):
        if not row or all(not c.strip() for c in row) or row[0].lstrip().startswith("#"):
            continue
        if lineno == 1 and row[0].strip().lower() == "time":
            continue
        ev = _parse_row(row, f"{path} line {lineno}", job)
        events.append(Event(ev.time_s, ev.worker, ev.kind, lineno))
    return check_events(events, str(path))


def write_trace(events: list[Event], path: str | Path) -> None:
    """Write events as a CSV trace that read_trace reads back."""
    lines = ["time,worker,event"] + [f"{e.time_s:.3f},{e.worker[0]}:{e.worker[1]},{e.kind}" for e in events]
    Path(path).write_text("\n".join(lines) + "\n")


MAX_GENERATED_FAILURES = 1_000_000  # a generated trace's expected failures: minutes of simulation


def generate_trace(job: JobSpec, mtbf_s: float, repair_s: float, duration_s: float, seed: int) -> list[Event]:
    """Exponential time to failure per worker (mean `mtbf_s`), fixed repair time, seeded.

    Workers draw in (d, s) order from one random.Random(seed), so a seed fixes the trace.
    """
    if mtbf_s <= 0 or repair_s < 0 or duration_s <= 0:
        raise InvalidInputError("mtbf and duration must be positive and repair non-negative")
    workers = job.num_pipelines * job.num_stages
    expected = workers * duration_s / (mtbf_s + repair_s)
    if expected > MAX_GENERATED_FAILURES:
        raise InvalidInputError(
            f"--duration {duration_s:g} s at a worker MTBF of {mtbf_s:g} s over {workers} "
            f"workers is about {expected:.3g} failures; at most {MAX_GENERATED_FAILURES:,} are simulated "
            "(shorten --duration or raise --mtbf)"
        )
    rng = random.Random(seed)
    events = []
    for d in range(job.num_pipelines):
        for s in range(job.num_stages):
            t = 0.0
            while True:
                t += rng.expovariate(1.0 / mtbf_s)
                if t >= duration_s:
                    break
                events.append(Event(t, (d, s), FAIL))
                t += repair_s
                if t >= duration_s:
                    break
                events.append(Event(t, (d, s), REJOIN))
    return check_events(events, "generated trace")
