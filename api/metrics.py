"""The service's Prometheus metrics, kept with prometheus_client in a registry of their own per app.

Each `create_app` builds one `Metrics`: its families are registered in a `CollectorRegistry` of that
instance, never in prometheus_client's global default registry, so several apps in one process (the
tests) neither collide nor share counts. `render()` is prometheus_client's text exposition
(`generate_latest`), served with `CONTENT_TYPE`.

Multi-process mode: a replica is one service process (its solver subprocesses export no metrics), so
by default the values live in this process's memory. When `PROMETHEUS_MULTIPROC_DIR` is set (it must be
set before prometheus_client is imported, i.e. in the service's environment), prometheus_client keeps
the values in files in that directory, and `render()` merges every process's files with a
`MultiProcessCollector`; `close()` marks this process dead so its live gauges stop counting.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiproc_dir() -> str | None:
    """The directory of prometheus_client's multi-process mode, or None when it is off."""
    return os.environ.get(MULTIPROC_ENV) or None


class Metrics:
    """The service's metric families (prometheus_client objects: `.labels(...)`, `.inc()`, `.observe()`)."""

    def __init__(self) -> None:
        self.multiproc_dir = multiproc_dir()
        self.registry = CollectorRegistry()
        if self.multiproc_dir is not None:
            # The families write to files; the registry that is rendered holds only the collector that
            # reads them back (prometheus_client: it must not also hold the families themselves).
            os.makedirs(self.multiproc_dir, exist_ok=True)
            multiprocess.MultiProcessCollector(self.registry, path=self.multiproc_dir)
        own = None if self.multiproc_dir is not None else self.registry
        self.request_seconds = Histogram(
            "recycle_http_request_duration_seconds",
            "HTTP request latency.",
            ["route", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self.solves = Counter(
            "recycle_solves_total",
            "Planner solves by purpose and outcome.",
            ["purpose", "source"],
            registry=own,
        )
        self.solve_seconds = Histogram(
            "recycle_solve_duration_seconds",
            "Planner solve wall time.",
            ["purpose"],
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self.cache = Counter(
            "recycle_plan_cache_total", "Event plan lookups by result (hit/miss).", ["result"], registry=own
        )
        self.versions = Counter(
            "recycle_schedule_versions_total", "Schedule versions published.", registry=own
        )
        self.pollers = Gauge(
            "recycle_connected_pollers",
            "Schedule long-polls waiting now.",
            multiprocess_mode="livesum",
            registry=own,
        )
        self.jobs = Gauge(
            "recycle_jobs", "Jobs known to this process.", multiprocess_mode="livemax", registry=own
        )
        self.heartbeat_failures = Counter(
            "recycle_heartbeat_failures_total", "Workers declared failed for silence.", registry=own
        )

    def render(self) -> bytes:
        """All families in Prometheus text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def close(self) -> None:
        """At shutdown: in multi-process mode, drop this process's live gauges (pollers, jobs)."""
        if self.multiproc_dir is not None:
            multiprocess.mark_process_dead(os.getpid(), self.multiproc_dir)
