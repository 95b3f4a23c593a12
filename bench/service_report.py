"""The figures of bench.service: percentiles, the limits that bound the number of pollers, and the
side-by-side markdown table (one column per back-end, with the issue's targets)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.service_clients import raise_nofile


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank, in milliseconds."""
    s = sorted(values)
    return 1000 * s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "n": len(values),
        "p50_ms": pct(values, 50),
        "p99_ms": pct(values, 99),
        "max_ms": 1000 * max(values),
        "mean_ms": 1000 * statistics.fmean(values),
    }


def ceiling(pollers: int, replicas: int, procs: int) -> dict[str, Any]:
    """How many pollers fit: file descriptors per replica process and per client process (after
    raising RLIMIT_NOFILE to its hard limit) and ephemeral ports per replica address."""
    soft, hard = raise_nofile()
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    limits = {  # 200 / 50 descriptors kept for each process's own files, pipes and database sockets
        "file descriptors per replica (RLIMIT_NOFILE)": (soft - 200) * replicas,
        "file descriptors per client process (RLIMIT_NOFILE)": (soft - 50) * procs,
        "ephemeral ports (ip_local_port_range) per replica address": (high - low + 1) * replicas,
    }
    reason, most = min(limits.items(), key=lambda kv: kv[1])
    return {"nofile": [soft, hard], "ceiling": most, "bound_by": reason, "fits": pollers <= most}


def _p(fig: dict[str, float] | None, b: str = "p99_ms") -> str:
    return "-" if fig is None else f"{fig['p50_ms']:.1f} / {fig[b]:.1f} ms"


def _cpu(r: dict[str, Any]) -> str:
    return "{per_immediate_poll:.2f} / {per_long_poll:.2f} / {per_event_post_and_fan_out:.0f} ms".format(
        **r["service_cpu_ms"]
    )


ROWS: list[tuple[str, str, Any]] = [  # label, target, figure of one back-end's results
    (
        "pollers answered of asked / errors",
        "all, none",
        lambda r: f"{r['answered']} of {r['pollers'] * r['events']} / {r['errors'] or 0}",
    ),
    ("every poller parked after (per event)", "", lambda r: ", ".join(f"{x} s" for x in r["connect_all_s"])),
    ("event to all pollers, p50 / p99", "p99 < 1 s", lambda r: _p(r["fan_out_event_to_all_pollers"])),
    (
        "the same per replica (the first took the POST)",
        "",
        lambda r: ", ".join(map(_p, r["fan_out_by_replica"])),
    ),
    ("immediate poll, p50 / p99", "p99 < 20 ms", lambda r: _p(r["immediate_poll"])),
    (
        "precomputed event POST, no poller waiting, p50 / p99",
        "p99 < 50 ms",
        lambda r: _p(r["precomputed_event_post_no_pollers"]),
    ),
    (
        "precomputed event POST, pollers parked, p50 / max",
        "< 50 ms",
        lambda r: _p(r["precomputed_event_post_with_pollers"], "max_ms"),
    ),
    ("service CPU per immediate poll / long-poll / event (POST + fan-out)", "reported", _cpu),
    (
        "load average (1 min) before / after",
        "",
        lambda r: " / ".join(f"{x[0]:.1f}" for x in r["load_average"].values()),
    ),
]


def table(results: dict[str, dict[str, Any]]) -> str:
    """The figures as a markdown table, one column per back-end, and the targets."""
    names = [f"{r['backend']}, {r['replicas']} replica{'s' * (r['replicas'] > 1)}" for r in results.values()]
    lines = ["| figure | " + " | ".join(names) + " | target |", "| --- |" + " --- |" * (len(names) + 1)]
    for label, target, f in ROWS:
        lines.append(f"| {label} | " + " | ".join(f(r) for r in results.values()) + f" | {target} |")
    return "\n".join(lines)
