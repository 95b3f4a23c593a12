"""The figures table that `recycle plan` and `recycle validate` print."""

from __future__ import annotations

from typing import Any

# Below this (relative) a gap prints as 0.000% anyway.
_SHOWN = 5e-6
# Deeper below a bound than this is no K-iteration transient (docs/planner.md, "Gaps below zero").
_TRANSIENT = 1e-3


def fmt_gap(gap: float | None) -> str:
    """A gap to a bound as a percentage; a negative one is clamped to 0 and explained."""
    if gap is None:
        return "-"
    if gap > -_SHOWN:
        return f"{max(gap, 0.0):.3%}"
    if gap > -_TRANSIENT:
        return f"{0.0:.3%} (measured {gap:.3%}: below a proven bound, float noise; see docs/planner.md)"
    return f"{gap:.3%} (below a proven bound by more than noise or a transient: a bug, please report it)"


def fmt_drift(report: dict[str, Any]) -> str:
    """How the claimed steady state differs from the K-iteration figure, and how it was found."""
    period, n = report.get("steady_period", 0), report.get("steady_iterations", 0)
    if not period:
        return f"{report['drift']:+.4%} (not settled in {n} iterations: an estimate)"
    found = f"repeats every {period} iteration(s), found after {n} replayed"
    return f"{report['drift']:+.4%} ({found})"


def fmt_workers(workers: list[list[int]]) -> str:
    return " ".join(f"[{d},{s}]" for d, s in workers) or "none"


def fmt_slow(slow: list[dict[str, Any]]) -> str:
    return " ".join(f"[{w['worker'][0]},{w['worker'][1]}] x{w['factor']:g}" for w in slow) or "none"


def render_summary(fig: dict[str, Any], report: dict[str, Any]) -> str:
    """Key/value figures and the per-stage memory table. Solver figures (planned by, greedy,
    cp-sat, own failure-free plan) appear only when `fig` has them (`recycle plan`)."""
    from planner.outputs import render_key_values, render_table

    t = fig["iteration_time_ms"]
    pairs: list[tuple[str, object]] = [
        ("job", fig["job"]),
        ("failed workers", fmt_workers(fig["failed"])),
        ("slow workers (factor)", fmt_slow(fig.get("slow", []))),
        ("iteration time (ms)", t),
    ]
    if "baseline_1f1b_ms" in fig:
        pairs += [
            ("failure-free 1F1B (ms)", fig["baseline_1f1b_ms"]),
            ("throughput retained vs failure-free 1F1B", f"{fig['throughput_retained']:.2%}"),
        ]
    if "own_failure_free_ms" in fig:
        pairs += [
            ("failure-free plan of this planner (ms)", fig["own_failure_free_ms"]),
            (
                "throughput retained vs that plan",
                f"{fig['throughput_retained_vs_own_failure_free']:.2%}",
            ),
        ]
    pairs += [
        ("load lower bound (ms)", report["lower_bound_ms"]),
        ("gap to load bound", fmt_gap(report["gap"])),
    ]
    if "memory_bound_ms" in fig:
        pairs += [
            ("memory-aware bound (ms)", fig["memory_bound_ms"]),
            ("gap to memory-aware bound", fmt_gap(fig["gap_to_memory_bound"])),
        ]
    if "source" in fig:
        pairs += [
            ("planned by", fig["source"]),
            ("greedy", f"{fig['greedy_ms']:.3f} ms in {fig['greedy_s']:.2f} s"),
        ]
        cp = fig.get("cpsat") or {}
        if cp:
            detail = f"{cp.get('status')}"
            if cp.get("method") == "windows":
                steps, better = cp["steps"], cp["improvements"]
                detail = f"window re-solves: {steps} steps, {better} improved, {cp['wall_s']:.1f} s"
            elif cp.get("wall_s") is not None:
                detail += f" in {cp['wall_s']:.1f} s, proven bound {cp.get('cpsat_bound_ms') or 0:.3f} ms"
            elif cp.get("reason"):
                detail += f" ({cp['reason']})"
            pairs.append(("cp-sat", detail))
    pairs += [
        ("bubble ratio", f"{report['bubble_ratio']:.2%}"),
        ("replayed iterations K", report["num_iterations"]),
    ]
    if "k_iteration_ms" in report:
        pairs += [
            (f"iteration time at K={report['num_iterations']} (ms)", report["k_iteration_ms"]),
            ("steady state vs K figure", fmt_drift(report)),
        ]
    rows = [
        [s, peak, cap if cap is not None else "unlimited"]
        for s, (peak, cap) in enumerate(
            zip(report["peak_memory_by_stage"], report["capacity_by_stage"], strict=True)
        )
    ]
    return render_key_values(pairs) + "\n\n" + render_table(["stage", "peak MiB", "capacity MiB"], rows)
