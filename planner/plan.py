"""The adaptive planner: greedy portfolio first, CP-SAT where it can still gain, referee always.

plan() is the one entry point the CLI and the service call. It normalizes the scenario (pipeline
permutations share a plan), builds orders with the greedy list scheduler over a small portfolio of
policies, hands the best to CP-SAT only when it is measurably above the lower bound, replays every
candidate with the independent simulator, and maps the winner back to the physical workers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache

from planner.adaptive.greedy import GreedyOptions
from planner.adaptive.lookahead import LookaheadOptions, round_trips_covered, run_policy, slack_stages
from planner.bounds import load_bound, memory_bound
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.normalize import Normalized, job_fingerprint, normalize, to_physical
from planner.orders import Orders, to_schedule
from planner.problem import Problem
from planner.reduced import expand, reduce_job, stand_in_own
from planner.reduced import host_variants as reduced_host_variants
from planner.settings import planner_settings
from planner.simulator import ValidationReport, validate

log = logging.getLogger(__name__)

GAIN_THRESHOLD = 1e-3  # a schedule within 0.1% of the best bound is not worth a solve
GOOD_ENOUGH = 5e-4  # the greedy portfolio stops within 0.05% of the best bound
HOST_SEARCH_SHARE = 0.7  # share of the greedy budget kept for the host-map search (host_search.py)
CRITICAL_BUDGET = 2.0  # the critical-cycle search's budget on a reduced grid, in greedy budgets
SMALL_OPS = 12_000  # up to this many ops per iteration the greedy simulates more iterations

# Tried in order; stops early once a schedule meets the bound. Each differs in how eagerly deferred
# W fills idle time and how many activations a worker keeps in flight (see GreedyOptions).
PORTFOLIO: tuple[GreedyOptions, ...] = (
    GreedyOptions(),
    GreedyOptions(w_patience=0.3),
    GreedyOptions(w_patience=0.6),
    GreedyOptions(w_patience=1.0),
    GreedyOptions(w_patience=1.0, inflight_extra=2),
    GreedyOptions(w_patience=0.3, inflight_extra=1),
    GreedyOptions(w_patience=0.3, inflight_extra=2),
    GreedyOptions(w_patience=0.6, inflight_extra=2),
)

# Tried where a stage has slack (docs/planner.md 4c), on the first host map whatever the budget:
# neither patience is best everywhere (0.6 can be 8% off when stage 0 is in the saturated chain).
LOOKAHEAD: tuple[LookaheadOptions, ...] = (LookaheadOptions(b_patience=0.3), LookaheadOptions(b_patience=0.6))

Progress = Callable[[str], None]


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


@dataclass
class Candidate:
    """A schedule, the problem (host map) and orders it came from, and who made it."""

    problem: Problem
    orders: Orders
    schedule: Schedule
    label: str


def _fits_memory(problem: Problem, orders: Orders) -> bool:
    """Whether every worker's order stays within its stage's capacity (peak depends on order only)."""
    job = problem.job
    for (_, s), order in orders.items():
        cap = job.capacity_mib(s)
        if cap is None:
            continue
        prof, mem, peak = job.stages[s], 0.0, 0.0
        for op, _ in order:
            if op == "F":
                mem += prof.activation_mib
            elif op == "B":
                mem += prof.weight_grad_mib - prof.activation_mib
            elif op in ("W", "BW"):
                mem -= prof.weight_grad_mib if op == "W" else prof.activation_mib
            peak = max(peak, mem)
        if peak > cap * (1 + 1e-9):
            return False
    return True


def baseline_candidates(job: JobSpec, scenario: FailureScenario, problem: Problem) -> list[Candidate]:
    """Memory-feasible baseline orders (ZB-H1 and 1F1B on the balanced hosts, naive re-route on its
    own, ZB-H1 with longer W delays: planner/adaptive/zb_delays.py): the planner never returns
    anything slower than what they give."""
    from planner.baselines import BASELINES

    out = []
    for name, prob in (
        ("zb-h1", problem),
        ("1f1b", problem),
        ("naive-reroute", BASELINES["naive-reroute"].build_problem(job, scenario)),
    ):
        orders = BASELINES[name].build_orders(prob)
        if _fits_memory(prob, orders):
            out.append(Candidate(prob, orders, to_schedule(prob, orders, strategy=name), name))
    from planner.adaptive.zb_delays import DELAYS, zb_delay_orders

    for name, delay in DELAYS.items():
        orders = zb_delay_orders(problem, delay)
        if _fits_memory(problem, orders):
            out.append(Candidate(problem, orders, to_schedule(problem, orders, strategy=name), name))
    return out


def _redeferred(best: Candidate) -> Candidate:
    """`best`, or its F/B skeleton with the Ws re-placed by ZB's delays where that is faster
    (planner/adaptive/zb_delays.py `redeferred_orders`; two replays)."""
    from planner.adaptive.zb_delays import redeferred_orders

    base = best
    for name, orders in redeferred_orders(base.problem, base.orders).items():
        if not _fits_memory(base.problem, orders):
            continue
        sched = to_schedule(base.problem, orders, strategy=name)
        if sched.iteration_time_ms < best.schedule.iteration_time_ms - 1e-9:
            best = Candidate(base.problem, orders, sched, f"{base.label}+{name}")
    return best


def _critical(seeds: list[Candidate], target_ms: float, budget_s: float) -> Candidate:
    """The best of `seeds` and of what the critical-cycle search (planner/adaptive/critical_moves.py)
    makes of each, fastest seed first, within `budget_s` seconds for all: a search stuck in a local
    optimum ends early and leaves its time to the next seed."""
    from planner.adaptive.critical_moves import critical_search

    t0 = time.perf_counter()
    best = min(seeds, key=lambda c: c.schedule.iteration_time_ms)
    for seed in sorted(seeds, key=lambda c: c.schedule.iteration_time_ms):
        left = budget_s - (time.perf_counter() - t0)
        if left <= 0 or best.schedule.iteration_time_ms <= target_ms:
            break
        ms = seed.schedule.iteration_time_ms
        found = critical_search(seed.problem, seed.orders, ms, target_ms, left, _fits_memory)
        if found is not None and found[1] < best.schedule.iteration_time_ms - 1e-9:
            sched = to_schedule(seed.problem, found[0], strategy="critical")
            best = Candidate(seed.problem, found[0], sched, f"{seed.label}+critical")
    return best


def host_variants(job: JobSpec, scenario: FailureScenario) -> list[Problem]:
    """Balanced host maps that differ in which peers take the micro-batches that do not divide
    evenly: ascending pipelines, descending, and pipelines alive at the most failed stages first."""
    failed = {(d, s) for d, s in scenario.failed}
    failed_stages = {s for _, s in failed}
    alive_count = {d: sum(1 for s in failed_stages if (d, s) not in failed) for d in range(job.num_pipelines)}
    prefs: list[list[int] | None] = [
        None,
        list(range(job.num_pipelines))[::-1],
        sorted(range(job.num_pipelines), key=lambda d: (-alive_count[d], -d)),
    ]
    problems: list[Problem] = []
    for prefer in prefs:
        prob = Problem.build(job, scenario, prefer=prefer)
        if all(prob.host != other.host for other in problems):
            problems.append(prob)
    return problems


def plan_greedy(
    job: JobSpec,
    scenario: FailureScenario,
    target_ms: float,
    budget_s: float,
    progress: Progress | None = None,
    problems: list[Problem] | None = None,
) -> Candidate:
    """Best greedy schedule over the portfolio (host maps x policies), replayed by the simulator.

    Each greedy run simulates several iterations; the order of every simulated iteration is a
    candidate (they differ: the greedy is not periodic, the replay of a fixed order is). Stops once
    a candidate is within GOOD_ENOUGH of `target_ms`, or once `budget_s` seconds are spent (the
    default policy always runs on every host map). `problems`: the host maps (default host_variants).
    """
    t0 = time.perf_counter()
    problems = problems or host_variants(job, scenario)
    num_ops = 3 * job.num_pipelines * job.num_microbatches * job.num_stages
    iterations = 6 if num_ops <= SMALL_OPS else 4
    # Where a stage has slack, the look-ahead policies (planner/adaptive/lookahead.py). Where memory
    # covers every round trip they run on the first host map, like the default one on every host
    # map, whatever the budget: the first right after the default policy there, the others after
    # the default on every map (then on the other maps); where it does not (-mem1x) they come last,
    # within the budget only: earlier they took budget from policies that did better there.
    looks = LOOKAHEAD if slack_stages(problems[0]) else ()
    first = bool(looks) and round_trips_covered(problems[0])
    policies = (PORTFOLIO[0], *looks, *PORTFOLIO[1:]) if first else (*PORTFOLIO, *looks)
    trials = [
        (dataclasses.replace(opts, num_iterations=iterations), prob) for opts in policies for prob in problems
    ]
    for k in range(len(looks) if first else 0):  # (look k, first map) sits at (k+1)*len(problems)
        trials.insert(1 if k == 0 else len(problems) + k, trials.pop((k + 1) * len(problems)))
    guaranteed = len(problems) + (len(looks) if first else 0)
    target_ms *= 1 + GOOD_ENOUGH
    best: Candidate | None = None
    for i, (opts, problem) in enumerate(trials):
        run = run_policy(problem, opts)
        seen: list[Orders] = []
        for orders in reversed(run.orders_by_iteration):
            if orders in seen:
                continue
            seen.append(orders)
            sched = to_schedule(problem, orders, strategy="recycle-greedy")
            if best is None or sched.iteration_time_ms < best.schedule.iteration_time_ms - 1e-9:
                best = Candidate(problem, orders, sched, "greedy")
            if best.schedule.iteration_time_ms <= target_ms * (1 + 1e-9):
                break
        assert best is not None
        if progress:
            progress(
                f"greedy trial {i + 1}/{len(trials)} done (policy x host map), "
                f"best iteration time so far {best.schedule.iteration_time_ms:.3f} ms"
            )
        if best.schedule.iteration_time_ms <= target_ms * (1 + 1e-9):
            break
        if i + 1 >= guaranteed and time.perf_counter() - t0 > budget_s:
            break  # the default policy always gets every host map (see above); the rest within budget
    assert best is not None
    return best


def _search_hosts(best: Candidate, target_ms: float, budget_s: float) -> Candidate:
    """`best`, or a better greedy schedule on a host map the local search finds (host_search.py)."""
    from planner.adaptive.host_search import search_hosts

    found = search_hosts(
        best.problem,
        best.schedule.iteration_time_ms,
        target_ms * (1 + GOOD_ENOUGH),
        budget_s,
        num_iterations=4,
    )
    return best if found is None else Candidate(*found, "greedy-hosts")


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
    # Not on large jobs: one greedy run takes seconds there, too few trials for a search to pay.
    job_ops = 3 * job.num_pipelines * job.num_microbatches * job.num_stages
    search = red is None and mb <= lb * (1 + 1e-9) and job_ops <= SMALL_OPS
    best = plan_greedy(
        small,
        norm.scenario,
        target_ms=mb,
        budget_s=budget_s * (1 - HOST_SEARCH_SHARE) if search else budget_s,
        progress=progress,
        problems=variants,
    )
    if best.schedule.iteration_time_ms > mb * (1 + 1e-9):
        best = _redeferred(best)  # the greedy's skeleton with ZB's W placement
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
            best = _critical(seeds, mb * (1 + GOOD_ENOUGH), CRITICAL_BUDGET * budget_s)
    cpsat_limit = time_limit
    if search and best.schedule.iteration_time_ms > mb * (1 + GAIN_THRESHOLD):
        # Where memory binds (mb > lb) the search never paid. It spends what the portfolio left of the
        # greedy budget (docs/planner.md section 4b).
        t1 = time.perf_counter()
        best = _search_hosts(best, mb, budget_s - (t1 - t0))
        # Its time comes out of CP-SAT's (down to half): on these cases CP-SAT rarely gains.
        cpsat_limit = max(time_limit / 2, time_limit - timedelta(seconds=time.perf_counter() - t1))
    greedy_s = time.perf_counter() - t0
    greedy_ms = best.schedule.iteration_time_ms
    source = best.label
    cpsat_info: dict[str, object] = {}
    num_ops = sum(len(o) for o in best.orders.values())
    if use_cpsat and greedy_ms > mb * (1 + GAIN_THRESHOLD):
        if num_ops <= settings.cpsat_max_ops:
            from planner.adaptive.refine import refine_with_cpsat

            improved, cpsat_info = refine_with_cpsat(best.problem, best.orders, cpsat_limit, lb, mb, progress)
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
