"""The on-disk plan cache: one JSON file per normalized scenario key, written atomically.

`<dir>/<key>.json` holds a recycle plan (canonical scenario, figures and schedule) or the record
that the scenario is unrecoverable. Other strategies' figures go to `<dir>/<strategy>/<key>.json`
so a second `recycle simulate` or `recycle whatif` replays nothing it has seen. Keys come from
planner.normalize and include the job fingerprint, so one directory can serve several jobs.

`recycle precompute` also writes `<dir>/index-<job fingerprint>.json` (`write_index`): the job spec,
the largest failure count covered and every normalized failure set with its key. That index is
what `recycle launch --schedules DIR` opens (runtime_adapter/schedules.py): it proves the plans are
for the launch's job and says how far they go.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from planner.contract import JobSpec
from planner.normalize import job_fingerprint

log = logging.getLogger(__name__)

INDEX_FORMAT = "recycle-plan-index/1"


def index_name(job: JobSpec) -> str:
    """File name of `job`'s index in a plan directory."""
    return f"index-{job_fingerprint(job)}.json"


class PlanCache:
    """A directory of JSON records keyed by normalized scenario key (None: memory only)."""

    def __init__(self, root: str | Path | None) -> None:
        self.root = Path(root) if root is not None else None
        self._memory: dict[tuple[str, str], dict[str, Any]] = {}

    def path(self, key: str, kind: str = "") -> Path | None:
        """Where the record for (kind, key) lives; kind "" is the recycle plan itself."""
        if self.root is None:
            return None
        return (self.root / kind / f"{key}.json") if kind else self.root / f"{key}.json"

    def get(self, key: str, kind: str = "") -> dict[str, Any] | None:
        """The stored record, or None when absent or unreadable (a torn file is re-done)."""
        hit = self._memory.get((kind, key))
        if hit is not None:
            return hit
        path = self.path(key, kind)
        if path is None or not path.is_file():
            return None
        try:
            record: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable cache file %s: %s", path, exc)
            return None
        self._memory[kind, key] = record
        return record

    def put(self, key: str, record: dict[str, Any], kind: str = "") -> None:
        """Store `record`; the file appears complete or not at all (temp file + os.replace)."""
        self._memory[kind, key] = record
        path = self.path(key, kind)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(record, fh, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def write_index(self, job: JobSpec, max_failures: int, plans: list[dict[str, Any]]) -> Path | None:
        """Write (atomically) the index of `job`'s plans: every normalized failure set with up to
        `max_failures` failures, as {"key", "failed"} entries (`failed` in canonical numbering)."""
        if self.root is None:
            return None
        doc = {
            "format": INDEX_FORMAT,
            "fingerprint": job_fingerprint(job),
            "job": job.model_dump(mode="json"),
            "max_failures": max_failures,
            "plans": plans,
        }
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / index_name(job)
        fd, tmp = tempfile.mkstemp(prefix=".index.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def index_max_failures(self, job: JobSpec) -> int | None:
        """The failure count `job`'s index covers (None: no readable index)."""
        if self.root is None:
            return None
        try:
            return int(json.loads((self.root / index_name(job)).read_text())["max_failures"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def has(self, key: str, kind: str = "") -> bool:
        """Whether a complete record exists for (kind, key), without parsing it: files are written
        atomically, so a file that ends its JSON object is whole (anything else is re-done)."""
        if (kind, key) in self._memory:
            return True
        path = self.path(key, kind)
        if path is None:
            return False
        try:
            with path.open("rb") as fh:
                fh.seek(-1, os.SEEK_END)
                return fh.read(1) == b"}"
        except OSError:
            return False
