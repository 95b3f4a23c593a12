"""The on-disk plan cache: one JSON file per normalized scenario key, written atomically.

`<dir>/<key>.json` holds a recycle plan (canonical scenario, figures and schedule) or the record
that the scenario is unrecoverable. Other strategies' figures go to `<dir>/<strategy>/<key>.json`
so a second `recycle simulate` or `recycle whatif` replays nothing it has seen. Keys come from
planner.normalize and include the job fingerprint, so one directory can serve several jobs.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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
