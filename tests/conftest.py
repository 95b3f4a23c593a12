"""`@pytest.mark.gpu` tests run only where CUDA is available (never in CI here: they are skipped)."""

from __future__ import annotations

import os
import signal

import pytest

# One OpenMP thread for torch in this process and every process a test starts (workers, agents,
# profilers), as the launcher gives its workers (runtime_adapter/supervisor_procs.py): the tiny models
# gain nothing from more, and on a busy 2-core machine spinning OpenMP threads made a worker's
# iteration take seconds instead of milliseconds (the tests started by hand ran 5-10x slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The Ctrl+C tests signal the processes they start as a terminal would. A test run started in the
# background by a non-interactive shell (`cmd &` in a script, some CI runners) ignores SIGINT, and
# every process it starts would inherit that (exec keeps an ignored signal ignored): `recycle plan`
# then planned on through a Ctrl+C. Earlier, any CP-SAT solve in this process reset SIGINT to its
# default as a side effect (planner/cpsat/solve.py now leaves it alone), which hid this.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return  # torch is imported only when a GPU test was collected
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pg_server():  # type: ignore[no-untyped-def]
    """One throw-away PostgreSQL server for the session (bench/pg_cluster.py); skips the test when no
    PostgreSQL binaries are installed (.ci/run installs Debian's `postgresql`)."""
    from bench.pg_cluster import PgCluster, find_bindir

    if find_bindir() is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl, postgres): apt-get install postgresql")
    with PgCluster() as cluster:
        yield cluster


@pytest.fixture
def pg_database(pg_server, request: pytest.FixtureRequest) -> str:  # type: ignore[no-untyped-def]
    """The URL of a fresh database on the session's PostgreSQL server."""
    import re

    pg_database.count = getattr(pg_database, "count", 0) + 1  # type: ignore[attr-defined]
    name = re.sub(r"\W", "_", request.node.name.lower())[:40] + f"_{pg_database.count}"  # type: ignore[attr-defined]
    return str(pg_server.create_database(name))
