"""`recycle precompute`: plan every normalized scenario up to k failures, in worker processes (or as
Ray tasks on a cluster: whatif/precompute_ray.py).

Resumable: a scenario whose `<key>.json` already exists in the cache directory is skipped, and each
plan is written atomically as soon as it is done, so an interrupted run loses at most the plans in
flight. Reports how many physical failure sets normalization folded into how many plans. When every
plan is done it writes the job's index (`PlanCache.write_index`), which makes the directory one
`recycle launch --schedules DIR` can run from (a directory without it was interrupted: run again).
Planning is greedy only unless `use_cpsat` (bulk planning is where time matters).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, TextIO

from planner.contract import FailureScenario, JobSpec
from planner.processes import exit_with_parent
from whatif.cache import PlanCache
from whatif.scenarios import Canonical, canonical_scenarios
from whatif.strategies.recycle import DEFAULT_PLAN_TIME_LIMIT, plan_record

log = logging.getLogger(__name__)


class ProgressBar:
    """A one-line progress bar on a stream (stderr), silent when disabled. On a terminal it is redrawn
    in place; otherwise (a log file, CI) it prints a plain line at every tenth of the work."""

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        enabled: bool = True,
        after_s: float = 0.0,
    ) -> None:
        """`after_s`: say nothing until the work has taken that long (a quick run stays quiet)."""
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.after_s = after_s

    def advance(self, n: int = 1, note: str = "") -> None:
        """Count `n` more items done and redraw."""
        before, self.done = self.done, self.done + n
        if not self.enabled:
            return
        if self.after_s and time.perf_counter() - self.t0 < self.after_s:
            return
        if self.after_s:  # the first line after the quiet spell: not only at the next tenth
            self.after_s, before = 0.0, -self.total
        if not self.tty:
            step = max(1, self.total // 10)
            if self.done // step != before // step or self.done >= self.total:
                elapsed = time.perf_counter() - self.t0
                self.stream.write(
                    f"{self.label}: {self.done}/{self.total} done, {elapsed:.1f} s elapsed, {note[:60]}\n"
                )
                self.stream.flush()
            return
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.t0
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} done, {elapsed:.1f} s elapsed {note[:48]:<48}"
        )
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


@dataclass
class PrecomputeStats:
    """What a precompute run did."""

    physical_scenarios: int  # failure sets up to k failures, counted on the physical workers
    canonical_scenarios: int  # after normalization: plans needed
    already_cached: int
    planned: int
    unrecoverable: int
    wall_s: float

    @property
    def saved_by_normalization(self) -> int:
        return self.physical_scenarios - self.canonical_scenarios

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saved_by_normalization": self.saved_by_normalization}


class PlanningProcessDied(RuntimeError):
    """A local planning process ended abruptly (killed, out of memory): one line, exit 1; the plans
    written so far stay (run again to resume)."""

    def __init__(self, planned: int) -> None:
        super().__init__(
            f"a planning process died (killed, or out of memory?) after {planned} plans of this run; "
            "the plans written so far stay: run again to resume"
        )


def _pool_process(parent_pid: int) -> None:
    """Pool initializer: SIGTERM ends the process again (it inherits the CLI's handler, which turns
    SIGTERM into KeyboardInterrupt: a broken pool's SIGTERM to the other processes was then caught
    and the pool joined them forever), and the process ends with its parent."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    exit_with_parent(parent_pid)


def _plan_task(job_json: str, scenario_json: str, use_cpsat: bool, time_limit_s: float) -> dict[str, Any]:
    logging.getLogger("planner").setLevel(logging.WARNING)
    job = JobSpec.model_validate_json(job_json)
    scenario = FailureScenario.model_validate_json(scenario_json)
    return plan_record(job, scenario, use_cpsat=use_cpsat, time_limit=timedelta(seconds=time_limit_s))


def _todo(scenarios: Iterable[Canonical], cache: PlanCache) -> tuple[dict[str, Canonical], int]:
    """The scenarios whose key is not cached yet (one per key), and how many are."""
    todo: dict[str, Canonical] = {}
    already = 0
    for c in scenarios:
        if c.key in todo:
            continue
        if cache.has(c.key):
            already += 1
        else:
            todo[c.key] = c
    return todo, already


class Recorder:
    """Writes each finished plan record to the cache as it arrives and counts it on the progress bar
    (the local pool and the Ray path both report through it)."""

    def __init__(self, cache: PlanCache, total: int, progress: bool) -> None:
        self.cache = cache
        self.bar = ProgressBar(total, "planning scenarios", enabled=progress)
        self.planned = self.unrecoverable = 0

    def __call__(self, rec: dict[str, Any]) -> None:
        self.cache.put(rec["key"], rec)
        self.planned += 1
        self.unrecoverable += bool(rec["unrecoverable"])
        note = (
            "last: unrecoverable (a stage lost every worker)"
            if rec["unrecoverable"]
            else f"last plan: iteration time {rec['iteration_time_ms']:.1f} ms"
        )
        self.bar.advance(note=note)


def plan_missing(
    job: JobSpec,
    scenarios: Iterable[Canonical],
    cache: PlanCache,
    num_workers: int = 2,
    use_cpsat: bool = False,
    time_limit: timedelta = DEFAULT_PLAN_TIME_LIMIT,
    progress: bool = True,
    ray_address: str | None = None,
) -> tuple[int, int, int]:
    """Plan every scenario whose key is not cached; returns (already cached, planned, unrecoverable).
    `ray_address`: plan as tasks on that Ray cluster (whatif/precompute_ray.py) instead of
    `num_workers` local processes."""
    todo, already = _todo(scenarios, cache)
    record = Recorder(cache, len(todo), progress)
    if not todo:
        return already, 0, 0
    job_json = job.model_dump_json()
    limit_s = time_limit.total_seconds()
    if ray_address:
        from whatif.precompute_ray import plan_on_ray

        plan_on_ray(ray_address, job_json, [c.scenario for c in todo.values()], use_cpsat, limit_s, record)
        return already, record.planned, record.unrecoverable
    try:
        with local_pool(num_workers) as pool:
            pending: set[Future[dict[str, Any]]] = {
                pool.submit(_plan_task, job_json, c.scenario.model_dump_json(), use_cpsat, limit_s)
                for c in todo.values()
            }
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    record(fut.result())
    except BrokenProcessPool:
        raise PlanningProcessDied(record.planned) from None
    return already, record.planned, record.unrecoverable


@contextlib.contextmanager
def local_pool(num_workers: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of `num_workers` processes that end with this one (even killed: exit_with_parent).
    Left by an exception (Ctrl+C, a broken pool), it ends its processes instead of waiting for the
    tasks in flight: their results are lost anyway, and the processes would run the queued ones
    first (the exit waits for them)."""
    pool = ProcessPoolExecutor(max(1, num_workers), initializer=_pool_process, initargs=(os.getpid(),))
    done = False
    try:
        yield pool
        done = True
    finally:
        if not done:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
        pool.shutdown(wait=done, cancel_futures=True)


def precompute(
    job: JobSpec,
    max_failures: int,
    cache: PlanCache,
    num_workers: int | None = None,
    use_cpsat: bool = False,
    time_limit: timedelta = DEFAULT_PLAN_TIME_LIMIT,
    progress: bool = True,
    ray_address: str | None = None,
) -> PrecomputeStats:
    """Plan all normalized scenarios with 0..max_failures failures into `cache` (on the Ray cluster at
    `ray_address` when given, else in `num_workers` local processes)."""
    if max_failures < 0:
        raise ValueError("max_failures must be >= 0")
    t0 = time.perf_counter()
    num_workers = num_workers or min(2, os.cpu_count() or 1)
    scenarios = [c for k in range(max_failures + 1) for c in canonical_scenarios(job, k)]
    num_workers_total = job.num_pipelines * job.num_stages
    physical = sum(math.comb(num_workers_total, k) for k in range(max_failures + 1))
    already, planned, unrecoverable = plan_missing(
        job, scenarios, cache, num_workers, use_cpsat, time_limit, progress, ray_address
    )
    prior = cache.index_max_failures(job)
    if prior is None or prior < max_failures:  # an index that covers more stays (its plans are all there)
        index = [{"key": c.key, "failed": [list(w) for w in c.scenario.failed]} for c in scenarios]
        cache.write_index(job, max_failures, index)
    stats = PrecomputeStats(
        physical, len(scenarios), already, planned, unrecoverable, time.perf_counter() - t0
    )
    log.info("precompute: %s", stats)
    return stats
