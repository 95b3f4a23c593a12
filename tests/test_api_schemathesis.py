"""Schemathesis against the live service's /openapi.json: generated requests never get a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402

from tests.test_api_live import CTL, free_port, server  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SMALL = {  # keep generated jobs and waits small so every generated request answers quickly
    "RECYCLE_MAX_WAIT_S": "0.5",
    "RECYCLE_MAX_WORKERS_PER_JOB": "16",
    "RECYCLE_MAX_OPS_PER_JOB": "256",
    "RECYCLE_MAX_TIME_LIMIT_S": "1",
    "RECYCLE_MAX_FAILURES_CAP": "1",
}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    data: Path = tmp_path_factory.mktemp("schemathesis")
    with server(data, port, **SMALL):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def api_schema(live: str) -> Any:
    return schemathesis.openapi.from_url(f"{live}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: Any, live: str) -> None:
    case.call_and_validate(base_url=live, headers=CTL, checks=[not_a_server_error], timeout=30)
