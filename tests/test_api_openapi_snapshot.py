"""The OpenAPI schema is part of the contract with job controllers: changes must be deliberate.

Regenerate after an intended change:
    RECYCLE_UPDATE_SNAPSHOT=1 python -m pytest tests/test_api_openapi_snapshot.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from api.main import create_app
from api.settings import Settings

SNAPSHOT = Path(__file__).parent / "snapshots" / "openapi.json"


def test_openapi_schema_matches_snapshot(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path, controller_token="x"))  # type: ignore[arg-type]
    schema = json.dumps(app.openapi(), indent=1, sort_keys=True) + "\n"
    if os.environ.get("RECYCLE_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(schema)
    assert SNAPSHOT.exists(), "no snapshot yet: run with RECYCLE_UPDATE_SNAPSHOT=1"
    assert schema == SNAPSHOT.read_text(), "OpenAPI schema changed: review, then regenerate the snapshot"
