"""The workers' accounting files (`acct_<d>_<s>.jsonl`, one JSON record a line, appended by every
process of worker [d, s]): what external witnesses read to check exactly-once stepping and the loss.

Records (`event` field):

- `stepping` {it, version, hosted[, loss_sum, loss_n]}: written and flushed right before the gradient
  all-reduce of iteration `it`, the moment the step may become visible: peers step once every peer
  has contributed. Without a matching `step` it means "maybe stepped" (the worker died or was
  interrupted after contributing);
- `step` {it, version, hosted, wall_ms, op_ms[, loss_sum, loss_n]}: the worker stepped `it`
  (confirmed). The last stage adds `loss_sum` (sum of the unscaled mean losses of the micro-batches it
  ran F for) and `loss_n` (their number);
- `version` {version, from, groups, threads}: running schedule `version` from iteration `from`, with
  that many live process groups and OS threads; `rollback` {to, version}, `rejoin` {stepped, version},
  `resume` {stepped}, `checkpoint` {stepped, version}, `done` {stepped, groups, threads}.

Which steps count: for a (stage, iteration), the newest schedule version with a `step` record of that
stage (older steps were rolled back and replayed). At that version every `stepping` record of the
stage counts: a peer's `step` proves that the all-reduce completed, i.e. that every member contributed
(and wrote `stepping` before). `committed` applies this rule; `iteration_losses` gives the global loss
of each iteration: sum(loss_sum) / sum(loss_n) over the counted last-stage records.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime_adapter.assignment import Worker
from runtime_adapter.executor import IterationRecord


def acct_path(out_dir: Path, w: Worker) -> Path:
    """The accounting file of worker [d, s]."""
    return out_dir / f"acct_{w[0]}_{w[1]}.jsonl"


class Accounting:
    """Appends records to one worker's accounting file; each is flushed before `write` returns (a
    SIGKILL then cannot lose it; only a machine crash could, which would take the worker too)."""

    def __init__(self, path: Path, is_last_stage: bool) -> None:
        self.file = path.open("a")
        self.is_last_stage = is_last_stage

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def _iteration(self, event: str, rec: IterationRecord) -> dict[str, Any]:
        out: dict[str, Any] = {"event": event, "it": rec.iteration, "version": rec.version}
        out["hosted"] = [list(mb) for mb in rec.hosted]
        if self.is_last_stage:
            out["loss_sum"], out["loss_n"] = rec.loss_sum or 0.0, rec.loss_n
        return out

    def stepping(self, rec: IterationRecord) -> None:
        """The intent record, right before the all-reduce."""
        self.write(self._iteration("stepping", rec))

    def step(self, rec: IterationRecord) -> None:
        """The worker stepped `rec.iteration`."""
        self.write({**self._iteration("step", rec), "wall_ms": rec.wall_ms, "op_ms": rec.op_ms})

    def close(self) -> None:
        """Close the file."""
        self.file.close()


def read_records(out_dir: Path, w: Worker) -> list[dict[str, Any]]:
    """Every complete record of worker [d, s] (a torn last line is skipped)."""
    path = acct_path(out_dir, w)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def committed(
    out_dir: Path, num_pipelines: int, num_stages: int
) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """(stage, iteration) -> the records that count (one per contributing worker; see the module doc)."""
    newest: dict[tuple[int, int], int] = {}
    by_version: dict[tuple[int, int, int], dict[Worker, dict[str, Any]]] = {}
    for d in range(num_pipelines):
        for s in range(num_stages):
            for r in read_records(out_dir, (d, s)):
                if r.get("event") not in ("stepping", "step"):
                    continue
                key = (s, int(r["it"]), int(r["version"]))
                if r["event"] == "step":
                    newest[key[:2]] = max(newest.get(key[:2], -1), key[2])
                by_version.setdefault(key, {}).setdefault((d, s), r)
    return {(s, it): list(by_version[(s, it, v)].values()) for (s, it), v in newest.items()}


def iteration_losses(out_dir: Path, num_pipelines: int, num_stages: int) -> dict[int, float]:
    """Iteration -> the global loss (mean of the unscaled micro-batch losses of its global batch)."""
    out = {}
    for (s, it), records in committed(out_dir, num_pipelines, num_stages).items():
        if s == num_stages - 1:
            n = sum(int(r["loss_n"]) for r in records)
            out[it] = sum(float(r["loss_sum"]) for r in records) / n if n else float("nan")
    return dict(sorted(out.items()))
