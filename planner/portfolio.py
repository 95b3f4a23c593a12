"""The greedy portfolio of the adaptive planner (planner/plan.py): list-scheduler policies over a few
host maps, the baselines the planner never returns anything slower than, the ZB re-placement of Ws,
the critical-cycle search on reduced grids and the host-map search, and the tight-memory policies,
hill-climb and critical-cycle search (docs/planner.md sections 4-4e).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from planner.adaptive.greedy import GreedyOptions
from planner.adaptive.lookahead import LookaheadOptions, round_trips_covered, run_policy, slack_stages
from planner.adaptive.tight import TightOptions, neighbours, run_tight, tight_policies
from planner.bounds import load_bound
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.orders import Orders, to_schedule
from planner.problem import Problem

GOOD_ENOUGH = 5e-4  # the greedy portfolio stops within 0.05% of the best bound
SMALL_OPS = 12_000  # up to this many ops per iteration the greedy simulates more iterations
TIGHT_CRITICAL_SHARE = 0.4  # tight memory: share of the greedy budget for the critical-cycle search
CRITICAL_SEEDS = 3  # ... started from the best schedules of this many greedy trials
LONG_TRIAL_S = 20.0  # a first greedy trial longer than this and the budget: the other trials are skipped

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
class Candidate:
    """A schedule, the problem (host map) and orders it came from, and who made it."""

    problem: Problem
    orders: Orders
    schedule: Schedule
    label: str


def fits_memory(problem: Problem, orders: Orders) -> bool:
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
        if fits_memory(prob, orders):
            out.append(Candidate(prob, orders, to_schedule(prob, orders, strategy=name), name))
    from planner.adaptive.zb_delays import DELAYS, zb_delay_orders

    for name, delay in DELAYS.items():
        orders = zb_delay_orders(problem, delay)
        if fits_memory(problem, orders):
            out.append(Candidate(problem, orders, to_schedule(problem, orders, strategy=name), name))
    return out


def redeferred(best: Candidate) -> Candidate:
    """`best`, or its F/B skeleton with the Ws re-placed by ZB's delays where that is faster
    (planner/adaptive/zb_delays.py `redeferred_orders`; two replays)."""
    from planner.adaptive.zb_delays import redeferred_orders

    base = best
    for name, orders in redeferred_orders(base.problem, base.orders).items():
        if not fits_memory(base.problem, orders):
            continue
        sched = to_schedule(base.problem, orders, strategy=name)
        if sched.iteration_time_ms < best.schedule.iteration_time_ms - 1e-9:
            best = Candidate(base.problem, orders, sched, f"{base.label}+{name}")
    return best


def critical(seeds: list[Candidate], target_ms: float, budget_s: float) -> Candidate:
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
        found = critical_search(seed.problem, seed.orders, ms, target_ms, left, fits_memory)
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
    default policy always runs on every host map, unless its first run alone takes longer than the
    budget and LONG_TRIAL_S: D=P=M=64, about a minute). `problems`: the host maps (default host_variants).
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
    covered = round_trips_covered(job, scenario)
    first = bool(looks) and covered
    policies = (PORTFOLIO[0], *looks, *PORTFOLIO[1:]) if first else (*PORTFOLIO, *looks)
    trials: list[tuple[GreedyOptions, Problem]] = [
        (dataclasses.replace(opts, num_iterations=iterations), prob) for opts in policies for prob in problems
    ]
    for k in range(len(looks) if first else 0):  # (look k, first map) sits at (k+1)*len(problems)
        trials.insert(1 if k == 0 else len(problems) + k, trials.pop((k + 1) * len(problems)))
    guaranteed = len(problems) + (len(looks) if first else 0)
    climb_from = len(trials) + 1  # where the hill-climb over tight policies starts (none by default)
    policy_budget_s = budget_s
    if not covered and num_ops <= SMALL_OPS:
        # Tight memory (docs/planner.md 4e): its policies on the first map, right after the default
        # policy on every map, within the budget.
        binds = target_ms <= load_bound(job, scenario) * (1 + 1e-9)  # target_ms: the memory-aware bound
        tight = [
            (dataclasses.replace(opts, num_iterations=iterations), problems[0])
            for opts in tight_policies(binds)
        ]
        trials = trials[:guaranteed] + tight + [t for t in trials[guaranteed:] if t not in tight]
        climb_from = guaranteed + len(tight)
        guaranteed += 1  # the first tight policy runs whatever the budget
        policy_budget_s = budget_s * (1 - TIGHT_CRITICAL_SHARE)  # the rest: the critical-cycle search
    target_ms *= 1 + GOOD_ENOUGH
    best: Candidate | None = None
    best_opts, climbed = None, []
    tops: list[Candidate] = []  # each trial's best: the critical-cycle search's seeds (tight memory)
    first_s = 0.0  # how long the first trial took
    for i, (opts, problem) in enumerate(trials):  # the hill-climb below inserts trials ahead
        run = run_tight(problem, opts) if isinstance(opts, TightOptions) else run_policy(problem, opts)
        seen: list[Orders] = []
        for orders in reversed(run.orders_by_iteration):
            if orders in seen:
                continue
            seen.append(orders)
            sched = to_schedule(problem, orders, strategy="recycle-greedy")
            if policy_budget_s < budget_s and (
                len(seen) == 1 or sched.iteration_time_ms < tops[-1].schedule.iteration_time_ms - 1e-9
            ):
                tops[len(tops) - (len(seen) > 1) :] = [Candidate(problem, orders, sched, "greedy")]
            if best is None or sched.iteration_time_ms < best.schedule.iteration_time_ms - 1e-9:
                best = Candidate(problem, orders, sched, "greedy")
                best_opts = opts if problem is problems[0] else None
            if best.schedule.iteration_time_ms <= target_ms * (1 + 1e-9):
                break
        assert best is not None
        if i + 1 >= climb_from and best_opts is not None and best_opts not in climbed:
            # Tight memory: hill-climb from the best policy on the first map (tight.py neighbours).
            climbed.append(best_opts)
            near = [
                (dataclasses.replace(n, num_iterations=iterations), problems[0])
                for n in neighbours(best_opts)
            ]
            trials[i + 1 : i + 1] = [t for t in near if t not in trials[: i + 1]]
        if progress:
            progress(
                f"greedy trial {i + 1}/{len(trials)} done (policy x host map), "
                f"best iteration time so far {best.schedule.iteration_time_ms:.3f} ms"
            )
        if best.schedule.iteration_time_ms <= target_ms * (1 + 1e-9):
            break
        first_s = first_s or time.perf_counter() - t0
        slow = first_s > max(policy_budget_s, LONG_TRIAL_S)
        if (i + 1 >= guaranteed or slow) and time.perf_counter() - t0 > policy_budget_s:
            # The default policy gets every host map (see above), the rest runs within the budget; on a
            # job where one trial alone takes longer than that and LONG_TRIAL_S, only the first.
            break
    assert best is not None
    if policy_budget_s < budget_s and best.schedule.iteration_time_ms > target_ms * (1 + 1e-9):
        # Tight memory (4e): from the best CRITICAL_SEEDS trials' schedules, fastest first.
        seeds = sorted(tops, key=lambda c: c.schedule.iteration_time_ms)[:CRITICAL_SEEDS]
        best = critical(seeds, target_ms, budget_s - (time.perf_counter() - t0))
    return best


def search_hosts_from(best: Candidate, target_ms: float, budget_s: float) -> Candidate:
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
