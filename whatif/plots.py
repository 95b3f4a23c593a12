"""Plots for `recycle whatif` and `recycle simulate` (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from whatif.events import RunFigures
from whatif.table import WhatIf


def plot_whatif(result: WhatIf, strategies: list[str], path: str | Path) -> None:
    """Throughput retained (mean over placements, worst as a dashed line) versus failures."""
    fig, ax = plt.subplots(figsize=(8, 5))
    ks = sorted(result.coverage)
    by = {(c.strategy, c.num_failures): c for c in result.cells}
    for i, name in enumerate(strategies):
        color = f"C{i % 10}"
        ax.plot(ks, [by[name, k].mean_retained for k in ks], "o-", color=color, label=name)
        ax.plot(ks, [by[name, k].worst_retained for k in ks], ":", color=color, alpha=0.6)
    ax.set_xlabel("failed workers")
    ax.set_xticks(ks)
    ax.set_ylabel("throughput retained vs failure-free 1F1B")
    ax.set_title(f"{result.job}: mean (solid) and worst (dotted) over placements")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def binned_rate(segments: list[tuple[float, float, float]], duration_s: float, bin_s: float) -> list[float]:
    """Average rate per bin of `bin_s` seconds from (t0, t1, rate) segments (stalls have rate 0)."""
    num = max(1, int(duration_s // bin_s + (duration_s % bin_s > 0)))
    acc = [0.0] * num
    for t0, t1, rate in segments:
        if rate == 0.0:
            continue
        t = t0
        while t < min(t1, duration_s) - 1e-9:
            b = min(int(t // bin_s), num - 1)
            end = min(t1, (b + 1) * bin_s, duration_s)
            acc[b] += rate * (end - t)
            t = end
    return [a / bin_s for a in acc]


def plot_simulation(
    runs: dict[str, RunFigures], duration_s: float, base_rate: float, path: str | Path, title: str
) -> None:
    """Hourly throughput per strategy, as a fraction of failure-free 1F1B's micro-batch rate."""
    bin_s = 3600.0 if duration_s > 6 * 3600 else max(60.0, duration_s / 100)
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, (name, run) in enumerate(runs.items()):
        rates = binned_rate(run.segments, duration_s, bin_s)
        xs = [(j + 0.5) * bin_s / 3600.0 for j in range(len(rates))]
        ax.step(xs, [r / base_rate for r in rates], where="mid", color=f"C{i % 10}", label=name, lw=1)
    ax.set_xlabel("hours")
    ax.set_ylabel("throughput vs failure-free 1F1B")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
