"""Peak memory of each worker over a replay (CONTRACT.md section 4).

A micro-batch holds `activation_mib` on its host from the start of its F to the end of its B/BW,
and `weight_grad_mib` from the end of its B to the end of its W. Every such change happens at the
start or end of an op of the host itself, and a worker runs its ops one after another, so walking
the worker's nodes in order visits its memory events in time order. Events at equal times are
applied together before the level is read: intervals are [start, end), so an interval that ends
when another starts never overlaps it, and an empty one never counts.
"""

from __future__ import annotations

from planner.contract import JobSpec
from planner.simulator.structure import OP_B, OP_BW, OP_F, OP_W, Layout


def memory_deltas(job: JobSpec, lay: Layout) -> tuple[list[float], list[float]]:
    """Per node: memory change at its start, and at its end (MiB)."""
    act = [p.activation_mib for p in job.stages]
    wgrad = [p.weight_grad_mib for p in job.stages]
    at_start = [0.0] * lay.num_nodes
    at_end = [0.0] * lay.num_nodes
    workers, nw = lay.workers, lay.node_worker
    for j, op in enumerate(lay.node_op):
        s = workers[nw[j]][1]
        if op == OP_F:
            at_start[j] = act[s]
        elif op == OP_B:
            at_end[j] = wgrad[s] - act[s]
        elif op == OP_BW:
            at_end[j] = -act[s]
        elif op == OP_W:
            at_end[j] = -wgrad[s]
    return at_start, at_end


def peak_memory(
    lay: Layout,
    at_start: list[float],
    at_end: list[float],
    duration: list[float],
    starts: list[list[float]],
    ends: list[list[float]],
) -> list[float]:
    """Peak memory per listed worker, the maximum over every replayed iteration.

    `starts[k][j]` / `ends[k][j]` are node j's times in iteration k. Each iteration starts from an
    empty worker: every micro-batch of iteration k is released before that worker's OPT ends.
    """
    peaks = [0.0] * len(lay.workers)
    for wi in range(len(lay.workers)):
        events = [j for j in range(lay.first[wi], lay.first[wi + 1]) if at_start[j] or at_end[j]]
        if all(duration[j] > 0 for j in events):
            peaks[wi] = _peak_in_order(events, at_start, at_end)
        else:
            peaks[wi] = max(
                _peak_by_time(events, at_start, at_end, start, end)
                for start, end in zip(starts, ends, strict=True)
            )
    return peaks


def _peak_in_order(events: list[int], at_start: list[float], at_end: list[float]) -> float:
    """Exact when every op with a memory event takes time: then the level after each event is
    either held for a while or below the level after the next event (an F starting right away),
    so ties need no grouping and the peak does not depend on the iteration's times."""
    level = peak = 0.0
    for j in events:
        level += at_start[j]
        if level > peak:
            peak = level
        level += at_end[j]
        if level > peak:
            peak = level
    return peak


def _peak_by_time(
    events: list[int], at_start: list[float], at_end: list[float], start: list[float], end: list[float]
) -> float:
    """The general case: apply all events at one time before reading the level."""
    level = peak = 0.0
    now = float("-inf")
    for j in events:
        for delta, t in ((at_start[j], start[j]), (at_end[j], end[j])):
            if delta:
                if t > now:
                    if level > peak:
                        peak = level
                    now = t
                level += delta
    return max(peak, level)
