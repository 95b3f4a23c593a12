"""Local search over host maps: which peer hosts which re-routed micro-batch (docs/planner.md 4b).

The balanced host map (Problem.build) fixes only how many micro-batches each peer hosts; which ones
it hosts is a free choice that the bounds do not see, but the schedule does. With failures on
adjacent stages the busiest worker of each saturated stage must start its iteration with an F whose
input comes from the previous saturated stage, and which micro-batches it shares with the busiest
workers next to it decides whether those chains line up (on gpt3-6.7b-p8d4 [0,1] [1,2] [2,3] the
greedy on the balanced maps idles one F per iteration: 1.0158x the load bound; on maps this search
finds, 1.0005-1.002x).

A move swaps the hosts of two micro-batches of one failed stage with different hosts, at least one
of them re-routed (hosted outside its own pipeline): every peer keeps its count, so both bounds are
unchanged. Half the moves trade a micro-batch of a busiest peer for one re-routed to a lighter peer
(on the 6.7b case 3 in 30 of those improve the start, 1 in 30 uniform swaps). Moving a micro-batch
to an identical peer hosting one less (which changes which peers are the busiest) was tried too: it
never helped on gpt3-13b-p8d8 and slowed the 6.7b search. Each candidate map is judged by the
default greedy policy, its orders replayed by the simulator; a move is kept when the replayed
steady-state time drops (first improvement, seeded RNG).

Since the look-ahead policy (planner/adaptive/lookahead.py) the portfolio itself reaches these
bounds (6.7b and 175b 1.0000x, 13b 1.0004x), so the search rarely runs on adjacent failure sets; it
stays for what the portfolio leaves more than 0.1% above the bound (docs/planner.md 4b).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter

from planner.adaptive.greedy import GreedyOptions, run_greedy
from planner.contract import Schedule
from planner.errors import ScheduleRuleError
from planner.orders import Orders, to_schedule
from planner.problem import Problem

BUSIEST_SHARE = 0.5  # share of moves that trade a busiest peer's micro-batch
LAST_ITERATIONS = 3  # the greedy's last simulated iterations whose orders are candidates
MAX_EVALS = 32  # greedy runs per search: with a fixed seed the result does not depend on the load


def _evaluate(problem: Problem, opts: GreedyOptions) -> tuple[Orders, Schedule] | None:
    best: tuple[Orders, Schedule] | None = None
    run = run_greedy(problem, opts)
    seen: list[Orders] = []
    for orders in reversed(run.orders_by_iteration[-LAST_ITERATIONS:]):
        if orders in seen:
            continue
        seen.append(orders)
        try:
            sched = to_schedule(problem, orders, strategy="recycle-greedy")
        except ScheduleRuleError:  # cannot happen for greedy orders; never let a search step break a plan
            continue
        if best is None or sched.iteration_time_ms < best[1].iteration_time_ms - 1e-9:
            best = (orders, sched)
    return best


def _neighbour(problem: Problem, rng: random.Random, stages: list[int]) -> Problem | None:
    s = rng.choice(stages)
    host = problem.host
    keys = [k for k in host if k[0] == s]
    moved = [k for k in keys if host[k] != k[1]]
    if not moved:
        return None
    load = Counter(host[k] for k in keys)
    top = max(load.values())
    lighter = [k for k in moved if load[host[k]] < top]
    if lighter and rng.random() < BUSIEST_SHARE:
        # Targeted: a micro-batch of a busiest peer (own or not) for one re-routed to a lighter peer.
        a = rng.choice(lighter)
        others = [k for k in keys if load[host[k]] == top]
    else:
        a = rng.choice(moved)
        others = [k for k in keys if host[k] != host[a]]
    if not others:
        return None
    b = rng.choice(others)
    new = dict(host)
    new[a], new[b] = host[b], host[a]
    return dataclasses.replace(problem, host=new)


def search_hosts(
    problem: Problem,
    start_ms: float,
    target_ms: float,
    budget_s: float,
    num_iterations: int,
    seed: int = 0,
    max_evals: int = MAX_EVALS,
) -> tuple[Problem, Orders, Schedule] | None:
    """Hill-climb from `problem`'s host map (whose best schedule so far takes `start_ms`) until a
    schedule within `target_ms`, `max_evals` greedy runs or `budget_s` seconds (the wall-time cap:
    on a loaded machine the search may stop earlier than `max_evals`).
    Returns the best improvement found (problem, orders, replayed schedule), or None."""
    stages = sorted({s for s in range(problem.num_stages) if len(problem.alive[s]) < problem.num_pipelines})
    if not stages or budget_s <= 0:
        return None
    opts = GreedyOptions(num_iterations=num_iterations)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    cur, cur_ms = problem, start_ms
    found: tuple[Problem, Orders, Schedule] | None = None
    for _ in range(max_evals):
        if cur_ms <= target_ms * (1 + 1e-9) or time.perf_counter() - t0 > budget_s:
            break
        cand = _neighbour(cur, rng, stages)
        if cand is None:
            break
        res = _evaluate(cand, opts)
        if res is not None and res[1].iteration_time_ms < cur_ms - 1e-9:
            cur, cur_ms = cand, res[1].iteration_time_ms
            found = (cand, res[0], res[1])
    return found
