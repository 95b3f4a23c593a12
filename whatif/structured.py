"""Baseline replays that use the grid's structure: the same figures as the full replay, on a smaller job.

On llama3-405b-p16d128 (128 pipelines x 16 stages) one full replay of a baseline schedule takes
~10 s, and `recycle simulate` needs one per baseline per failure set it visits. But pipelines that
a failure set does not touch run identical orders with identical dependencies: each of their ops
waits only on its own pipeline, and the OPT of stage s waits on the latest W/BW of ALL alive
workers of s, the same value for every one of them. So their times are equal, and the replay of
a job with ONE of them (plus the touched pipelines) gives the same times for every op it keeps:
bitwise, since every start is the maximum of the same numbers. Concretely (`reduced_case`):

- naive re-route hosting (1f1b, naive-reroute, zb-h1): a failed worker [d, s]'s micro-batches are
  dealt round-robin to the first alive peers of s; with the failed pipelines numbered first (the
  normalized form `Strategy.outcome` passes), the touched pipelines are a prefix 0..T-1, and the
  job cut to T+1 pipelines deals them to the same peers. Failure-free: T = 0, one pipeline.
- 1f1b-survivors (shrink): each survivor is a plain pipeline over the n micro-batches it hosts,
  n in {M + q, M + q + 1} with q, r = divmod(K*M, D-K) for K dropped pipelines, so its times depend
  on n only, and the dropped pipelines' alive workers only run OPT (at the same time as their
  stage's peers). The smallest job (K' dropped of D') whose dealing gives the same classes of n
  has the same figures.

Anything else (slow workers, failed pipelines not numbered first, a round-robin that wraps, other
baselines) is replayed in full. tests/test_whatif_structured.py checks equality with the full
replay over many small cases.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from functools import lru_cache

from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError, ScheduleRuleError

REROUTE_HOSTED = ("1f1b", "naive-reroute", "zb-h1")
SURVIVORS = "1f1b-survivors"


def _failed_pipelines_first(job: JobSpec, scenario: FailureScenario) -> list[int] | None:
    """The failed pipelines when they are 0..K-1 (the normalized form), else None."""
    pipes = sorted({d for d, _ in scenario.failed})
    return pipes if pipes == list(range(len(pipes))) else None


def _reroute_pipelines(job: JobSpec, scenario: FailureScenario) -> int | None:
    """How many leading pipelines the naive re-route hosting of `scenario` needs (touched + one
    untouched), or None when the structure does not apply."""
    pipes = _failed_pipelines_first(job, scenario)
    if pipes is None:
        return None
    num_d, num_m = job.num_pipelines, job.num_microbatches
    failed = {(d, s) for d, s in scenario.failed}
    touched = len(pipes)
    for s in range(job.num_stages):
        lost = sum((d, s) in failed for d in range(num_d))
        if not lost:
            continue
        alive = [d for d in range(num_d) if (d, s) not in failed]
        if lost * num_m >= len(alive):  # the dealing wraps, or no peer is left untouched
            return None
        touched = max(touched, alive[lost * num_m - 1] + 1)
    return touched + 1 if touched + 1 < num_d else None


def _survivor_shape(job: JobSpec, scenario: FailureScenario) -> tuple[int, int] | None:
    """(dropped, pipelines) of the smallest job whose 1f1b-survivors hosting has the same classes
    of survivor loads as `scenario`'s, or None when the structure does not apply."""
    pipes = _failed_pipelines_first(job, scenario)
    if pipes is None:
        return None
    num_d, num_m, k = job.num_pipelines, job.num_microbatches, len(pipes)
    if k == 0:
        return (0, 1) if num_d > 1 else None
    kept = num_d - k
    if kept <= 0:
        return None  # nothing survives: the full path raises the baseline's own error
    q, r = divmod(k * num_m, kept)
    best: tuple[int, int] | None = None
    for dropped in range(1, k + 1):
        for survivors in range(1, kept + 1):
            q2, r2 = divmod(dropped * num_m, survivors)
            if q2 < q:
                break
            if q2 == q and (r2 > 0) == (r > 0):
                if best is None or dropped + survivors < best[1]:
                    best = (dropped, dropped + survivors)
                break
    return best if best is not None and best[1] < num_d else None


def reduced_case(
    name: str, job: JobSpec, scenario: FailureScenario
) -> tuple[JobSpec, FailureScenario] | None:
    """A smaller (job, scenario) whose `name` baseline has the same iteration time and cold-start
    makespan as (job, scenario)'s, or None when none is known (module docstring)."""
    if scenario.slow:
        return None
    if name in REROUTE_HOSTED:
        pipelines = _reroute_pipelines(job, scenario)
        if pipelines is None:
            return None
        return job.model_copy(update={"num_pipelines": pipelines}), scenario
    if name == SURVIVORS:
        shape = _survivor_shape(job, scenario)
        if shape is None:
            return None
        dropped, pipelines = shape
        small = FailureScenario(failed=[(d, 0) for d in range(dropped)])
        return job.model_copy(update={"num_pipelines": pipelines}), small
    return None


def baseline_times(
    name: str, job: JobSpec, scenario: FailureScenario, check_memory: bool = True
) -> tuple[float, float]:
    """(iteration time, cold-start makespan = the first iteration's largest end_ms) of baseline
    `name` on (job, scenario): planner.baselines' schedule, replayed on the reduced job when the
    structure allows (same figures), else on the whole grid. Raises what baseline_schedule raises,
    and, `check_memory`, ScheduleRuleError("memory") when a worker of the schedule peaks over its
    stage's capacity (the strategy would run out of memory: it cannot run this failure set)."""
    from planner.baselines import BASELINES

    if name not in BASELINES:
        raise InvalidInputError(f"unknown baseline {name!r}; known: {', '.join(sorted(BASELINES))}")
    iteration_ms, cold_ms, breach = replayed(replay_key(name, job, scenario))
    if check_memory and breach is not None:
        raise ScheduleRuleError("memory", breach)
    return iteration_ms, cold_ms


ReplayKey = tuple[str, str, str]  # (baseline, job JSON, scenario JSON) of what is replayed
Replayed = tuple[float, float, str | None]  # (iteration time, cold-start makespan, memory breach)
MAX_REMEMBERED = 100_000  # replays kept in memory per process (~400 bytes each: the keys are hashed)
_remembered: OrderedDict[tuple[str, str, str], Replayed] = OrderedDict()
_remembered_lock = threading.Lock()  # callers may replay from several threads


def replay_key(name: str, job: JobSpec, scenario: FailureScenario) -> ReplayKey:
    """What `baseline_times(name, job, scenario)` replays: the reduced job and scenario where the
    structure allows (many failure sets share one: 1f1b-survivors' share the number of dropped
    pipelines), else the whole grid."""
    case = reduced_case(name, job, scenario)
    small, small_scenario = case if case is not None else (job, scenario)
    return name, small.model_dump_json(), small_scenario.model_dump_json()


def _short(key: ReplayKey) -> tuple[str, str, str]:
    return key[0], hashlib.sha256(key[1].encode()).hexdigest(), hashlib.sha256(key[2].encode()).hexdigest()


def replay(key: ReplayKey) -> Replayed:
    """The replay of `key`, computed here (what whatif/prefetch.py's processes run)."""
    name, job_json, scenario_json = key
    return _replayed(
        name, JobSpec.model_validate_json(job_json), FailureScenario.model_validate_json(scenario_json)
    )


def remember(key: ReplayKey, result: Replayed) -> None:
    """Keep a replay's figures for `replayed` (the least recently used go past MAX_REMEMBERED)."""
    short = _short(key)
    with _remembered_lock:
        _remembered[short] = result
        _remembered.move_to_end(short)
        while len(_remembered) > MAX_REMEMBERED:
            _remembered.popitem(last=False)


def is_remembered(key: ReplayKey) -> bool:
    return _short(key) in _remembered


def replayed(key: ReplayKey) -> Replayed:
    """The replay of `key`, remembered: recycle+barrier's estimate and reroute+decoupled replay the
    same ZB-H1 orders, and whatif/prefetch.py computes a trace's replays ahead in processes."""
    short = _short(key)
    with _remembered_lock:
        hit = _remembered.get(short)
        if hit is not None:
            _remembered.move_to_end(short)  # the least recently used go first
    if hit is None:
        hit = replay(key)
        remember(key, hit)
    return hit


def _replayed(name: str, job: JobSpec, scenario: FailureScenario) -> tuple[float, float, str | None]:
    """(iteration time, cold-start makespan, the validator's memory breach or None)."""
    from planner.baselines import BASELINES
    from planner.simulator.engine import replay_orders
    from planner.simulator.report import capacity_breach

    baseline = BASELINES[name]
    problem = baseline.build_problem(job, scenario)
    # The orders baseline_schedule would stamp into a document, replayed without building it. The
    # reduced job keeps every kept worker's order, so its peaks too.
    with_memory = any(job.capacity_mib(s) is not None for s in range(job.num_stages))
    result = replay_orders(job, scenario, baseline.build_orders(problem), with_memory=with_memory)
    breach = capacity_breach(job, result.peak_memory_mib)
    ends = [end for times in result.first_iteration_times.values() for _, end in times]
    # to_schedule stamps end_ms rounded to 6 decimals; the makespan is the largest of those.
    return result.iteration_time_ms, round(max(ends, default=0.0), 6), breach


@lru_cache(maxsize=64)
def _failure_free_1f1b(job_json: str) -> float:
    return baseline_times("1f1b", JobSpec.model_validate_json(job_json), FailureScenario())[0]


def failure_free_1f1b_ms(job: JobSpec) -> float:
    """planner.plan.baseline_1f1b_ms(job) (failure-free 1F1B, fused BW) from a one-pipeline replay."""
    return _failure_free_1f1b(job.model_dump_json())
