"""The baseline replays a trace will need, computed ahead in processes (`recycle simulate`, `whatif`).

simulate evaluates every strategy on each failure set as the trace reaches it, one at a time. On a
large grid the replays of the baseline schedules are where the time goes (0.2-0.4 s each on
gpt3-175b-p16d16, where a failed worker's 64 micro-batches are dealt over every peer, so no smaller
grid gives the same figures: whatif/structured.py), and they do not depend on each other. So before
the run the failure sets of the trace are collected, each strategy says which replays it would run
(`Strategy.replays`), and `--workers` processes compute the distinct ones; the run then finds them
remembered (`whatif.structured.replayed`). What is not remembered, the run replays itself as
before: a replay that raised (it raises again there), and, if a process of the pool died, whatever
was not done yet (a line says so). With one worker, or fewer than two replays to do, nothing
happens here. Some replays may go unused: a strategy that fell back to a checkpoint restart does
not evaluate the sets until it is back.
"""

from __future__ import annotations

import sys
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures.process import BrokenProcessPool

from planner.contract import FailureScenario, JobSpec
from planner.normalize import normalize
from whatif.strategies.base import Strategy
from whatif.structured import MAX_REMEMBERED, Replayed, ReplayKey, is_remembered, remember, replay, replay_key


def needed(
    job: JobSpec, strategies: dict[str, Strategy], scenarios: list[FailureScenario]
) -> list[ReplayKey]:
    """The distinct replays `strategies` would run on `scenarios`, in the order first needed."""
    keys: dict[ReplayKey, None] = {}
    seen: set[str] = set()
    for scenario in scenarios:
        norm = normalize(job, scenario)
        if norm.key in seen:
            continue
        seen.add(norm.key)
        for strategy in strategies.values():
            for name in strategy.replays(norm.scenario):
                key = replay_key(name, job, norm.scenario)
                if not is_remembered(key):
                    keys[key] = None
    return list(keys)


def _task(key: ReplayKey) -> tuple[ReplayKey, Replayed | None]:
    try:
        return key, replay(key)
    except Exception:  # the run replays it again and reports it where it did before
        return key, None


def prefetch(
    job: JobSpec,
    strategies: dict[str, Strategy],
    scenarios: list[FailureScenario],
    num_workers: int,
    progress: bool = True,
) -> int:
    """Compute the replays `strategies` need on `scenarios` in `num_workers` processes and remember
    them; how many were computed. A killed process ends this early: the run replays the rest."""
    from whatif.precompute import ProgressBar, local_pool

    # More than half what a process remembers would push out the first ones before the run used them.
    keys = needed(job, strategies, scenarios)[: MAX_REMEMBERED // 2] if num_workers > 1 else []
    if len(keys) < 2:
        return 0
    bar = ProgressBar(len(keys), "baseline replays", enabled=progress, after_s=1.0)
    done = 0
    try:
        with local_pool(min(num_workers, len(keys))) as pool:
            pending: set[Future[tuple[ReplayKey, Replayed | None]]] = {pool.submit(_task, k) for k in keys}
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    key, result = fut.result()
                    if result is not None:
                        remember(key, result)
                        done += 1
                    bar.advance()
    except BrokenProcessPool:
        print(
            f"a baseline replay process died: the run replays the other {len(keys) - done} itself",
            file=sys.stderr,
            flush=True,
        )
    return done
