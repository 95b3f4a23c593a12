"""The adaptive planner: greedy portfolio first, CP-SAT where it can still gain, referee always.

plan() is the one entry point the CLI and the service call. It normalizes the scenario (pipeline
permutations share a plan), builds orders with the greedy list scheduler over a small portfolio of
policies, hands the best to CP-SAT only when it is measurably above the lower bound, replays every
candidate with the independent simulator, and maps the winner back to the physical workers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache

from planner.adaptive.lookahead import round_trips_covered
from planner.bounds import load_bound, memory_bound
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.normalize import Normalized, job_fingerprint, normalize, to_physical
from planner.portfolio import (
    GOOD_ENOUGH,
    SMALL_OPS,
    Candidate,
    Progress,
    baseline_candidates,
    critical,
    plan_greedy,
    redeferred,
    search_hosts_from,
)
from planner.reduced import expand, reduce_job, stand_in_own
from planner.reduced import host_variants as reduced_host_variants
from planner.settings import planner_settings
from planner.simulator import ValidationReport, validate

log = logging.getLogger(__name__)

GAIN_THRESHOLD = 1e-3  # a schedule within 0.1% of the best bound is not worth a solve
HOST_SEARCH_SHARE = 0.7  # share of the greedy budget kept for the host-map search (host_search.py)
CRITICAL_BUDGET = 2.0  # the critical-cycle search's budget on a reduced grid, in greedy budgets
WINDOWS_MIN_OPS = 1000  # window re-solves (tight memory) from this size; below, the whole model
FUSED_REASON = (
    "the orders fuse some backwards into BW (a weight gradient larger than its activation would not fit "
    "in memory), which the CP-SAT model, splitting every backward into B and W, does not express"
)


@dataclass
class PlanResult:
    """A validated schedule and the figures a user judges it by."""

    schedule: Schedule
    report: ValidationReport
    lower_bound_ms: float
    memory_bound_ms: float
    baseline_1f1b_ms: float
    greedy_ms: float
    greedy_s: float
    source: str  # "greedy", "cpsat", or the baseline whose orders won ("zb-h1", ...)
    key: str
    cpsat: dict[str, object] = field(default_factory=dict)

    @property
    def iteration_time_ms(self) -> float:
        return self.schedule.iteration_time_ms

    @property
    def throughput_retained(self) -> float:
        """Failure-free 1F1B iteration time over this schedule's: 1.0 means no loss at all."""
        return self.baseline_1f1b_ms / self.iteration_time_ms if self.iteration_time_ms else 1.0

    def figures(self, own_failure_free_ms: float | None = None) -> dict[str, object]:
        """JSON-able summary (the CLI's --json, the benchmark and the service read this).

        Keys added by planner.figures.derived_figures: slow, throughput_retained_vs_1f1b, the
        clamped gaps, measured_below_bound, and own_failure_free_ms with
        throughput_retained_vs_own_failure_free when the caller planned the empty scenario.
        """
        from planner.figures import derived_figures, gap

        fig: dict[str, object] = {
            "job": self.schedule.job,
            "failed": [list(w) for w in self.schedule.failed],
            "iteration_time_ms": self.iteration_time_ms,
            "baseline_1f1b_ms": self.baseline_1f1b_ms,
            "throughput_retained": self.throughput_retained,
            "lower_bound_ms": self.lower_bound_ms,
            "memory_bound_ms": self.memory_bound_ms,
            "gap_to_lower_bound": gap(self.iteration_time_ms, self.lower_bound_ms),
            "gap_to_memory_bound": gap(self.iteration_time_ms, self.memory_bound_ms),
            "greedy_ms": self.greedy_ms,
            "greedy_s": self.greedy_s,
            "source": self.source,
            "cpsat": self.cpsat,
            "key": self.key,
            "validation": self.report.to_dict(),
        }
        return derived_figures(fig, self.schedule, own_failure_free_ms)


@lru_cache(maxsize=64)
def _baseline_1f1b_cached(fingerprint: str, job_json: str) -> float:
    from planner.baselines import baseline_schedule

    # Failure-free 1F1B pipelines are identical and meet only at the OPT all-reduce, whose condition
    # they reach at the same instant: one pipeline has the same times (planner/reduced.py's argument).
    job = JobSpec.model_validate_json(job_json).model_copy(update={"num_pipelines": 1})
    return baseline_schedule("1f1b", job, FailureScenario()).iteration_time_ms


def baseline_1f1b_ms(job: JobSpec) -> float:
    """Iteration time of failure-free 1F1B (fused backward) for this job: what users run today."""
    return _baseline_1f1b_cached(job_fingerprint(job), job.model_dump_json())


def plan(
    job: JobSpec,
    scenario: FailureScenario,
    time_limit: timedelta | None = None,
    use_cpsat: bool = True,
    progress: Progress | None = None,
) -> PlanResult:
    """Plan `scenario` for `job`: a validated schedule on the physical workers, with its figures.

    `time_limit` bounds CP-SAT (default RECYCLE_SOLVER_TIME_LIMIT_S). The greedy portfolio before it
    may keep trying policies, once the default policy has run on every host map, for
    RECYCLE_GREEDY_BUDGET_S but never longer than `time_limit` (sharing it with the host-map search,
    docs/planner.md section 4b, whose time comes out of CP-SAT's); models above RECYCLE_CPSAT_MAX_OPS ops
    keep the greedy plan (planner/settings.py). Raises InvalidInputError / UnrecoverableScenarioError
    for bad input; never returns a schedule the simulator rejects.
    """
    settings = planner_settings()
    if time_limit is None:
        time_limit = settings.solver_time_limit
    scenario.check_against(job)
    norm: Normalized = normalize(job, scenario)
    lb = load_bound(job, norm.scenario)
    mb = memory_bound(job, norm.scenario)
    t0 = time.perf_counter()
    red = reduce_job(job, norm.scenario)  # plan on a reduced grid where the structure allows
    small = job if red is None else red.job
    variants = None if red is None else reduced_host_variants(red, norm.scenario)
    budget_s = min(settings.greedy_budget, time_limit).total_seconds()
    # Where the host-map search may run (after the portfolio), the portfolio gets its share of the budget.
    # Not on large jobs: one greedy run takes seconds there, too few trials for a search to pay; not
    # where memory does not cover a round trip (it never paid there, section 4e: the tight policies run).
    job_ops = 3 * job.num_pipelines * job.num_microbatches * job.num_stages
    covered = round_trips_covered(job, norm.scenario)
    # (without a capacity the bound may exceed the load bound through few micro-batches, not memory)
    uncapped = job.memory_capacity_mib is None
    search = red is None and (mb <= lb * (1 + 1e-9) or uncapped) and job_ops <= SMALL_OPS and covered
    best = plan_greedy(
        small,
        norm.scenario,
        target_ms=mb,
        budget_s=budget_s * (1 - HOST_SEARCH_SHARE) if search else budget_s,
        progress=progress,
        problems=variants,
    )
    if best.schedule.iteration_time_ms > mb * (1 + 1e-9):
        best = redeferred(best)  # the greedy's skeleton with ZB's W placement
        seeds = [best]
        # A reduced grid has up to three host maps and cheap replays: the baselines run on each.
        for prob in variants or [best.problem]:
            for cand in baseline_candidates(small, norm.scenario, prob):
                if red is not None and not stand_in_own(red, cand.problem):
                    continue
                if cand.schedule.iteration_time_ms < best.schedule.iteration_time_ms - 1e-9:
                    best = cand
        if red is not None:  # cheap replays: the critical-cycle search gets twice the greedy budget
            seeds += [best] if best is not seeds[0] else []  # the greedy's and the best baseline
            best = critical(seeds, mb * (1 + GOOD_ENOUGH), CRITICAL_BUDGET * budget_s)
    cpsat_limit = time_limit
    if search and best.schedule.iteration_time_ms > mb * (1 + GAIN_THRESHOLD):
        # Where memory binds (mb > lb) the search never paid. It spends what the portfolio left of the
        # greedy budget (docs/planner.md section 4b).
        t1 = time.perf_counter()
        best = search_hosts_from(best, mb, budget_s - (t1 - t0))
        # Its time comes out of CP-SAT's (down to half): on these cases CP-SAT rarely gains.
        cpsat_limit = max(time_limit / 2, time_limit - timedelta(seconds=time.perf_counter() - t1))
    greedy_s = time.perf_counter() - t0
    greedy_ms = best.schedule.iteration_time_ms
    source = best.label
    cpsat_info: dict[str, object] = {}
    num_ops = sum(len(o) for o in best.orders.values())
    fused = any(op == "BW" for order in best.orders.values() for op, _ in order)
    if use_cpsat and greedy_ms > mb * (1 + GAIN_THRESHOLD):
        if fused:  # the model splits every backward into B and W (planner/cpsat/variables.py)
            cpsat_info = {"status": "SKIPPED", "reason": FUSED_REASON}
        elif num_ops <= settings.cpsat_max_ops:
            from planner.adaptive.refine import refine_with_cpsat

            # Where memory does not cover a round trip, window re-solves (section 5 of docs/planner.md);
            # a small model goes whole (CP-SAT may prove it optimal and stop early).
            windows = not covered and num_ops >= WINDOWS_MIN_OPS
            improved, cpsat_info = refine_with_cpsat(
                best.problem, best.orders, cpsat_limit, lb, mb, progress, windows=windows
            )
            if improved is not None and improved.iteration_time_ms < greedy_ms - 1e-9:
                best, source = Candidate(best.problem, {}, improved, "cpsat"), "cpsat"
        else:
            cpsat_info = {
                "status": "SKIPPED",
                "reason": f"{num_ops} ops > RECYCLE_CPSAT_MAX_OPS={settings.cpsat_max_ops}",
            }
    physical = to_physical(best.schedule if red is None else expand(red, best.schedule), norm, scenario)
    physical.strategy = "recycle-" + source
    report = validate(job, scenario, physical)
    return PlanResult(
        schedule=physical,
        report=report,
        lower_bound_ms=lb,
        memory_bound_ms=mb,
        baseline_1f1b_ms=baseline_1f1b_ms(job),
        greedy_ms=greedy_ms,
        greedy_s=greedy_s,
        source=source,
        key=norm.key,
        cpsat=cpsat_info,
    )
