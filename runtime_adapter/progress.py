"""Training progress of a launched job, read from the workers' accounting files (acct_<d>_<s>.jsonl).

`JobMonitor` reads only what was appended since its last call (a line still being written is read
next time) and keeps:

- each worker's stepped iterations (step, rollback, resume and rejoin records);
- the loss of each iteration: workers of the last stage add `loss_sum` (sum of the unscaled mean
  losses of the micro-batches they hosted) and `loss_n` (how many) to their stepping and step
  records; the loss of iteration `it` is sum(loss_sum) / sum(loss_n) over one record per last-stage
  worker of one schedule version,
  complete when sum(loss_n) == D * M. An iteration replayed after a rollback or a restore is
  reported once (a replay computes the same loss). Records without these fields are skipped;
- when a step of each schedule version was first seen (the summary's recovery times).

Completed iterations are appended to `loss.csv` (iteration, loss, version) as they complete; the
file (with its header) exists from the first poll on, even while no record carries a loss.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime_adapter.accounting import acct_path
from runtime_adapter.assignment import Worker

LOSS_CSV = "loss.csv"


@dataclass(frozen=True)
class IterationLoss:
    """The global loss of one iteration, from the last stage's step records of `version`."""

    iteration: int
    loss: float
    version: int


class JobMonitor:
    """Follows the accounting files of a D x P job (see the module docstring)."""

    def __init__(self, out_dir: Path, num_pipelines: int, num_stages: int, num_microbatches: int) -> None:
        self.out_dir = out_dir
        self.workers: list[Worker] = [(d, s) for d in range(num_pipelines) for s in range(num_stages)]
        self.last_stage, self.global_batch = num_stages - 1, num_pipelines * num_microbatches
        self.stepped: dict[Worker, int] = {w: 0 for w in self.workers}
        self.version_seen: dict[int, float] = {}
        self.losses: dict[int, IterationLoss] = {}
        self.loss_times: dict[int, float] = {}  # iteration -> monotonic time its loss completed
        self._offsets: dict[Worker, int] = {w: 0 for w in self.workers}
        # (it, version) -> last-stage worker -> (loss_sum, loss_n)
        self._groups: dict[tuple[int, int], dict[Worker, tuple[float, int]]] = {}
        self._new: list[IterationLoss] = []
        self._csv = out_dir / LOSS_CSV

    def _records(self, w: Worker) -> list[dict[str, Any]]:
        try:
            with acct_path(self.out_dir, w).open("rb") as f:
                f.seek(self._offsets[w])
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offsets[w] += end
        out = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out

    def poll(self, now: float | None = None) -> None:
        """Read what every worker appended since the last call."""
        now = time.monotonic() if now is None else now
        if not self._csv.exists() and self.out_dir.is_dir():
            self._csv.write_text("iteration,loss,version\n")
        for w in self.workers:
            for rec in self._records(w):
                self._take(w, rec, now)

    def _take(self, w: Worker, rec: dict[str, Any], now: float) -> None:
        event = rec.get("event")
        if event in ("stepping", "step"):
            it, version = int(rec["it"]), int(rec.get("version", 0))
            if event == "step":
                self.stepped[w] = it + 1
                self.version_seen.setdefault(version, now)
            # A worker killed right after the all-reduce leaves only its `stepping` record, which
            # carries the same loss (runtime_adapter/accounting.py): take whichever comes first.
            if w[1] == self.last_stage and "loss_sum" in rec and "loss_n" in rec:
                group = self._groups.setdefault((it, version), {})
                group.setdefault(w, (float(rec["loss_sum"]), int(rec["loss_n"])))
                total_n = sum(n for _, n in group.values())
                if total_n == self.global_batch and it not in self.losses:
                    done = IterationLoss(it, sum(x for x, _ in group.values()) / total_n, version)
                    self.losses[it] = done
                    self.loss_times[it] = now
                    self._new.append(done)
                    self._append_csv(done)
        elif event in ("rollback", "resume", "rejoin"):
            self.stepped[w] = int(rec.get("to", rec.get("stepped", self.stepped[w])))

    def _append_csv(self, row: IterationLoss) -> None:
        with self._csv.open("a") as f:
            f.write(f"{row.iteration},{row.loss:.6g},{row.version}\n")

    def new_losses(self) -> list[IterationLoss]:
        """Iterations whose loss completed since the last call, in the order they completed."""
        out, self._new = self._new, []
        return out

    def last_loss(self) -> IterationLoss | None:
        """The loss of the highest iteration known."""
        return self.losses[max(self.losses)] if self.losses else None

    def iterations_done(self, failed: set[Worker]) -> int:
        """Iterations every stage stepped: per stage the most any alive worker of it stepped (all its
        workers if none is alive: a lost stage stopped where they stopped), the minimum over stages."""
        per_stage: dict[int, list[int]] = {}
        for s in {w[1] for w in self.workers}:
            stage = [w for w in self.workers if w[1] == s]
            alive = [w for w in stage if w not in failed] or stage
            per_stage[s] = [self.stepped[w] for w in alive]
        return min((max(v) for v in per_stage.values()), default=0)

    def status_line(self, version: int, failed: set[Worker], target: int) -> str:
        """The slowest and fastest alive worker's stepped iterations, the version and the failed."""
        alive = [w for w in self.workers if w not in failed]
        if not alive:
            return f"schedule v{version}: no alive worker"
        counts = [self.stepped[w] for w in alive]
        lost = f", failed {sorted(list(w) for w in failed)}" if failed else ""
        return f"schedule v{version}: stepped {min(counts)}-{max(counts)} of {target} iterations{lost}"


def log_error(path: Path, max_lines: int = 3) -> str:
    """The error at the end of a worker log: the worker's own one-line error (`error: ...`, the
    exit-2 convention), the exception line after a traceback, else its last non-empty lines (joined
    with " | ")."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError as e:
        return f"(no log: {e})"
    if not lines:
        return "(empty log)"
    if lines[-1].startswith("error: "):
        return lines[-1].removeprefix("error: ")
    if any(ln.startswith("Traceback (most recent call last)") for ln in lines):
        return lines[-1]
    return " | ".join(lines[-max_lines:])


def last_step(path: Path, offset: int) -> int | None:
    """The iteration of the last step record in the accounting file `path` after byte `offset`."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return None
    it = None
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "step":
            it = int(rec["it"])
    return it
