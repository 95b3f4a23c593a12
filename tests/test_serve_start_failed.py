"""`recycle serve` when the application fails to start (its lifespan raised after the checks passed):
exit 1, as documented (docs/service.md), not uvicorn's own exit code 3."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")


@pytest.mark.timeout(60)
def test_a_store_that_cannot_open_is_exit_1(tmp_path: Path) -> None:
    # The up-front checks pass (a writable directory, no database file yet; a corrupt file is caught
    # by them, tests/test_api_cli.py), but SQLite cannot create its write-ahead log: a directory
    # stands where the file goes, so the store fails while the application starts.
    (tmp_path / "recycle.sqlite3-wal").mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "api.cli", "--port", "0", "--insecure-dev", "--data-dir", str(tmp_path)],
        env={k: v for k, v in os.environ.items() if not k.startswith("RECYCLE_")},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert "disk I/O error" in run.stderr and "Application startup failed" in run.stderr
