"""Decomposition for jobs too large for one model (gpt3-175b-p16d16: ~49k ops).

`improve_orders(..., stages=...)` frees only the workers of some stages; every other worker keeps
its hint order as a precedence chain (no intervals, no memory: its order alone fixes both). This
helper picks the stages where re-routing changed the work (failed or slow workers) and their
neighbours, which is where a generic order is most likely to leave bubbles.
"""

from __future__ import annotations

from planner.problem import Problem


def stages_to_reoptimise(problem: Problem, radius: int = 1, max_stages: int | None = None) -> list[int]:
    """Stages with a failed or slow worker, widened by `radius` on each side, at most `max_stages`
    (closest to a touched stage first). Without failures or slow workers: the last stage (the
    turnaround, where F and B meet) and its neighbours."""
    num_p = problem.num_stages
    touched = {s for s in range(num_p) if len(problem.alive[s]) < problem.num_pipelines}
    touched |= {s for (_, s), f in problem.factor.items() if f != 1.0}
    if not touched:
        touched = {num_p - 1}
    dist = {s: min(abs(s - t) for t in touched) for s in range(num_p)}
    chosen = sorted((s for s in range(num_p) if dist[s] <= radius), key=lambda s: (dist[s], s))
    if max_stages is not None:
        chosen = chosen[:max_stages]
    return sorted(chosen)
