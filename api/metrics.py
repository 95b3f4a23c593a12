"""A minimal Prometheus text-format registry (counters, gauges, histograms with labels).

Written by hand to keep the service image small; render() produces text/plain version 0.0.4.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

Labels = tuple[tuple[str, str], ...]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _fmt(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    body = ",".join(f'{k}="{v}"' for k, v in items)
    return "{" + body + "}"


class Metric:
    """One metric family."""

    def __init__(self, name: str, help_text: str, kind: str, buckets: tuple[float, ...] = ()) -> None:
        self.name, self.help, self.kind, self.buckets = name, help_text, kind, buckets
        self.values: dict[Labels, float] = defaultdict(float)
        self.counts: dict[Labels, list[int]] = {}
        self.sums: dict[Labels, float] = defaultdict(float)
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add to a counter or gauge."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            self.values[key] += amount

    def set(self, value: float, **labels: str) -> None:
        """Set a gauge."""
        with self._lock:
            self.values[tuple(sorted(labels.items()))] = value

    def observe(self, value: float, **labels: str) -> None:
        """Record one histogram observation."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            counts = self.counts.setdefault(key, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sums[key] += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        with self._lock:
            if self.kind != "histogram":
                for key, v in sorted(self.values.items()):
                    lines.append(f"{self.name}{_fmt(key)} {v:g}")
                return lines
            for key, counts in sorted(self.counts.items()):
                cum = 0
                for bound, c in zip((*self.buckets, float("inf")), counts, strict=True):
                    cum += c
                    le = "+Inf" if bound == float("inf") else f"{bound:g}"
                    lines.append(f"{self.name}_bucket{_fmt(key, (('le', le),))} {cum}")
                lines.append(f"{self.name}_sum{_fmt(key)} {self.sums[key]:g}")
                lines.append(f"{self.name}_count{_fmt(key)} {cum}")
        return lines


class Metrics:
    """The service's metric families."""

    def __init__(self) -> None:
        self.request_seconds = Metric(
            "recycle_http_request_duration_seconds", "HTTP request latency.", "histogram", LATENCY_BUCKETS
        )
        self.solves = Metric("recycle_solves_total", "Planner solves by purpose and outcome.", "counter")
        self.solve_seconds = Metric(
            "recycle_solve_duration_seconds", "Planner solve wall time.", "histogram", LATENCY_BUCKETS
        )
        self.cache = Metric("recycle_plan_cache_total", "Event plan lookups by result (hit/miss).", "counter")
        self.versions = Metric("recycle_schedule_versions_total", "Schedule versions published.", "counter")
        self.pollers = Metric("recycle_connected_pollers", "Schedule long-polls waiting now.", "gauge")
        self.jobs = Metric("recycle_jobs", "Jobs known to this process.", "gauge")
        self.heartbeat_failures = Metric(
            "recycle_heartbeat_failures_total", "Workers declared failed for silence.", "counter"
        )

    def render(self) -> str:
        """All families in Prometheus text format."""
        families = [
            self.request_seconds,
            self.solves,
            self.solve_seconds,
            self.cache,
            self.versions,
            self.pollers,
            self.jobs,
            self.heartbeat_failures,
        ]
        return "\n".join(line for m in families for line in m.render()) + "\n"
