"""ReCycle and its ablations, all as schedules replayed by planner.simulator (CONTRACT.md section 4).

- reroute-only:        naive re-route (failed workers' micro-batches dealt round-robin to peers,
                       fused BW), with a global barrier between iterations.
- reroute+decoupled:   ZB-H1 (split B/W, W deferred into bubbles) on the balanced re-routed hosts,
                       with a global barrier.
- reroute+decoupled+staggered: the same ZB-H1 orders without the barrier (the replay's own rule:
                       each worker starts its next iteration right after its own OPT).
- recycle:             planner.plan.plan() (adaptive greedy; CP-SAT only in `recycle precompute
                       --cpsat`), no barrier. Plans come from the on-disk cache when present; on a
                       miss the model plans (`exact`, the default) or, for `recycle simulate`
                       without `--exact`, takes a labelled estimate (whatif/estimate.py).

A global barrier makes every iteration start from an empty pipeline, so its iteration time is the
makespan of one iteration replayed from a cold start: the largest `end_ms` of the schedule's first
iteration, which the simulator already records on every action.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import InvalidInputError, ScheduleRuleError, UnrecoverableScenarioError
from planner.normalize import normalize
from whatif.cache import PlanCache
from whatif.strategies.base import Costs, Outcome, Strategy, lost_stages

log = logging.getLogger(__name__)

DEFAULT_PLAN_TIME_LIMIT = timedelta(seconds=3)


def barrier_ms(schedule: Schedule) -> float:
    """Iteration time with a global barrier: the first iteration's makespan from a cold start."""
    return max((a.end_ms for ws in schedule.workers for a in ws.actions), default=0.0)


def plan_record(
    job: JobSpec,
    scenario: FailureScenario,
    use_cpsat: bool = False,
    time_limit: timedelta = DEFAULT_PLAN_TIME_LIMIT,
    keep_schedule: bool = True,
) -> dict[str, Any]:
    """Plan the canonical form of `scenario` and return the cache record (never raises for an
    unrecoverable scenario: the record says so and names the stages)."""
    from planner.plan import plan

    norm = normalize(job, scenario)
    record: dict[str, Any] = {
        "key": norm.key,
        "job": job.name,
        "scenario": norm.scenario.model_dump(mode="json"),
    }
    lost = lost_stages(job, norm.scenario)
    if lost:
        return {**record, "unrecoverable": True, "stages": lost}
    t0 = time.perf_counter()
    try:
        result = plan(job, norm.scenario, time_limit=time_limit, use_cpsat=use_cpsat)
    except UnrecoverableScenarioError as exc:
        return {**record, "unrecoverable": True, "stages": list(exc.stages)}
    record.update(
        unrecoverable=False,
        iteration_time_ms=result.iteration_time_ms,
        barrier_ms=barrier_ms(result.schedule),
        lower_bound_ms=result.lower_bound_ms,
        memory_bound_ms=result.memory_bound_ms,
        baseline_1f1b_ms=result.baseline_1f1b_ms,
        source=result.source,
        use_cpsat=use_cpsat,
        plan_s=time.perf_counter() - t0,
    )
    if keep_schedule:
        record["schedule"] = result.schedule.model_dump(mode="json", exclude_none=True)
    return record


class Recycle(Strategy):
    """Adaptive re-routing schedules from planner.plan (the cache first, plan on a miss)."""

    name = "recycle"
    summary = "adaptive re-routed schedules (planner.plan), staggered optimizer"

    def __init__(
        self,
        job: JobSpec,
        costs: Costs,
        cache: PlanCache | None = None,
        time_limit: timedelta = DEFAULT_PLAN_TIME_LIMIT,
        exact: bool = True,
        use_plans: bool = True,
    ) -> None:
        """`exact`: plan a cache miss (else estimate it, whatif/estimate.py). `use_plans` False
        estimates every failure set, cached or not (to measure what the estimate changes)."""
        super().__init__(job, costs)
        self.cache = cache or PlanCache(None)
        self.time_limit = time_limit
        self.exact = exact
        self.use_plans = use_plans
        self.num_planned = 0  # plans made here (cache misses): a warm cache keeps this at 0
        self.used: dict[str, dict[str, Any]] = {}  # normalized key -> the record the model used

    @property
    def switch_s(self) -> float:
        return self.costs.reroute_s

    def record(self, scenario: FailureScenario) -> dict[str, Any]:
        """The cached plan record for `scenario`; on a miss, a plan (greedy only) when `exact`, else
        an estimate (labelled `estimated`, kept in memory, never written to the cache)."""
        key = normalize(self.job, scenario).key
        rec = self.cache.get(key) if self.use_plans else None
        if rec is None and not self.exact:
            from whatif.estimate import estimate_record

            rec = estimate_record(self.job, scenario, with_barrier=self._field == "barrier_ms")
        elif rec is None:
            log.info("plan cache miss for %s: planning", [list(w) for w in scenario.failed])
            rec = plan_record(self.job, scenario, time_limit=self.time_limit)
            self.cache.put(key, rec)
            self.num_planned += 1
        self.used[key] = rec
        return rec

    def replays(self, scenario: FailureScenario) -> tuple[str, ...]:
        """An estimated recycle+barrier record replays ZB-H1 (whatif/estimate.py)."""
        if self._field != "barrier_ms" or self.exact or lost_stages(self.job, scenario):
            return ()
        key = normalize(self.job, scenario).key
        return () if self.use_plans and self.cache.has(key) else ("zb-h1",)

    def evaluate(self, scenario: FailureScenario) -> Outcome:
        rec = self.record(scenario)
        if rec["unrecoverable"]:
            return Outcome(None, f"stage(s) {rec['stages']} have no alive worker")
        return Outcome(float(rec[self._field]))

    _field = "iteration_time_ms"


class RecycleBarrier(Recycle):
    """The recycle plan with a global barrier between iterations (no staggered optimizer)."""

    name = "recycle+barrier"
    summary = "recycle's plan with a global barrier between iterations"
    _field = "barrier_ms"


BASELINE_RECORD_VERSION = 2  # 2: over a memory capacity is fatal (before, timed as if it ran)


class BaselineSchedule(Strategy):
    """A planner.baselines schedule on the failure set, timed by the simulator."""

    baseline = "naive-reroute"
    barrier = True

    def __init__(self, job: JobSpec, costs: Costs, cache: PlanCache | None = None) -> None:
        super().__init__(job, costs)
        self.cache = cache or PlanCache(None)

    @property
    def switch_s(self) -> float:
        return self.costs.reroute_s

    def _cached(self, key: str) -> dict[str, Any] | None:
        rec = self.cache.get(key, kind=self.baseline)
        return rec if rec is not None and rec.get("version") == BASELINE_RECORD_VERSION else None

    def replays(self, scenario: FailureScenario) -> tuple[str, ...]:
        if lost_stages(self.job, scenario) or self._cached(normalize(self.job, scenario).key) is not None:
            return ()
        return (self.baseline,)

    def evaluate(self, scenario: FailureScenario) -> Outcome:
        from whatif.structured import baseline_times

        lost = lost_stages(self.job, scenario)
        if lost:
            return Outcome(None, f"stage(s) {lost} have no alive worker")
        key = normalize(self.job, scenario).key
        rec = self._cached(key)
        if rec is None:
            try:  # replayed on a reduced grid where the structure allows: same figures
                iteration_ms, cold_ms = baseline_times(self.baseline, self.job, scenario)
            except InvalidInputError as exc:
                rec = {"fatal": str(exc)}
            except ScheduleRuleError as exc:  # over a capacity: it would run out of memory
                rec = {"fatal": f"{self.baseline} runs out of memory: {exc.message}"}
            else:
                rec = {"iteration_time_ms": iteration_ms, "barrier_ms": cold_ms}
            rec["version"] = BASELINE_RECORD_VERSION
            self.cache.put(key, rec, kind=self.baseline)
        if "fatal" in rec:
            return Outcome(None, str(rec["fatal"]))
        return Outcome(float(rec["barrier_ms" if self.barrier else "iteration_time_ms"]))


class RerouteOnly(BaselineSchedule):
    name = "reroute-only"
    summary = "naive re-route, fused BW, global barrier"
    baseline, barrier = "naive-reroute", True


class RerouteDecoupled(BaselineSchedule):
    name = "reroute+decoupled"
    summary = "ZB-H1 split B/W on re-routed hosts, global barrier"
    baseline, barrier = "zb-h1", True


class RerouteDecoupledStaggered(BaselineSchedule):
    name = "reroute+decoupled+staggered"
    summary = "ZB-H1 split B/W on re-routed hosts, staggered optimizer"
    baseline, barrier = "zb-h1", False
