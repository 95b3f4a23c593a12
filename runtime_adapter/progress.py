"""Progress of a launched job, read from the workers' accounting files (acct_<d>_<s>.jsonl).

`recycle launch` prints one line every few seconds: the slowest and fastest worker's stepped
iterations, the schedule version and the failed workers, so a long run shows that it is alive.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from runtime_adapter.assignment import Worker


class StepProgress:
    """Follows the accounting files of a job's workers, reading only what was appended."""

    def __init__(self, out_dir: Path, workers: list[Worker], every_s: float = 5.0) -> None:
        self.out_dir, self.workers, self.every_s = out_dir, workers, every_s
        self.stepped: dict[Worker, int] = {w: 0 for w in workers}
        self._offsets: dict[Worker, int] = {w: 0 for w in workers}
        self._last = time.monotonic()

    def _read(self, w: Worker) -> None:
        path = self.out_dir / f"acct_{w[0]}_{w[1]}.jsonl"
        try:
            with path.open("rb") as f:
                f.seek(self._offsets[w])
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offsets[w] += end
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "step":
                self.stepped[w] = int(rec["it"]) + 1
            elif rec.get("event") in ("rollback", "resume", "rejoin"):
                self.stepped[w] = int(rec.get("to", rec.get("stepped", self.stepped[w])))

    def line(self, version: int, failed: set[Worker], target: int) -> str | None:
        """A progress line if `every_s` passed since the last one, else None."""
        now = time.monotonic()
        if now - self._last < self.every_s:
            return None
        self._last = now
        alive = [w for w in self.workers if w not in failed]
        for w in alive:
            self._read(w)
        if not alive:
            return f"schedule v{version}: no alive worker"
        counts = [self.stepped[w] for w in alive]
        lost = f", failed {sorted(list(w) for w in failed)}" if failed else ""
        return f"schedule v{version}: stepped {min(counts)}-{max(counts)} of {target} iterations{lost}"
