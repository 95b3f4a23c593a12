"""Replay of a schedule for K iterations (CONTRACT.md section 4): the referee's clock, and its
steady state (planner/simulator/steady.py: replayed on until the OPT ends repeat).

Dependencies inside one iteration never point to another iteration; the only link between
iterations is a worker's own order (its first op of iteration k+1 follows its OPT of iteration k).
So the orders deadlock exactly when one iteration's dependency graph has a cycle, and one
topological order of that graph, repeated K times, is a valid evaluation order for the whole run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import InvalidInputError, ScheduleRuleError
from planner.simulator.memory import memory_deltas, peak_memory
from planner.simulator.steady import SteadyState, settle
from planner.simulator.structure import OP_B, OP_BW, OP_F, OP_W, Layout, check_orders, check_structure

log = logging.getLogger(__name__)

MIN_ITERATIONS = 4
_MULTI = -2  # dep marker: an OPT, whose dependencies are listed in Graph.opt_deps
_MAX_STUCK_NAMED = 6

WorkerKey = tuple[int, int]


@dataclass
class Replay:
    """What the replay measured. Worker keys are (d, s)."""

    iteration_time_ms: float  # steady state: the limit of k_iteration_ms as K grows (steady.py)
    first_iteration_times: dict[WorkerKey, list[tuple[float, float]]]  # aligned with the actions
    peak_memory_mib: dict[WorkerKey, float]  # max over the K iterations
    busy_ms: dict[WorkerKey, float]  # op time per iteration
    num_iterations: int
    k_iteration_ms: float  # (end of last OPT of iter K - end of last OPT of iter 1) / (K - 1)
    steady: SteadyState  # how the steady state was found
    last_opt_end_ms: list[float] = field(default_factory=list)  # per iteration K, end of its last OPT
    # The same for every iteration replayed to find the steady state (at least num_iterations).
    replayed_opt_end_ms: list[float] = field(default_factory=list)


@dataclass
class Graph:
    """One iteration's nodes: duration, one dependency (node or -1 or _MULTI) with its delay."""

    duration: list[float]
    dep: list[int]
    delay: list[float]
    opt_deps: dict[int, list[int]]  # OPT node -> last W/BW node of each alive peer (delay: `delay`)


def build_graph(job: JobSpec, lay: Layout) -> Graph:
    """Durations and dependencies of every node, from the table of CONTRACT.md section 4."""
    num_p = lay.num_stages
    stride = lay.num_pipelines * lay.num_microbatches  # key distance between consecutive stages
    prof = job.stages
    base = [
        [p.forward, p.backward_input, p.backward_weight, p.backward_input + p.backward_weight, p.optimizer]
        for p in prof
    ]
    act_ms, cross_ms = job.comm.activation_ms, job.comm.cross_pipeline_ms
    n = lay.num_nodes
    pipe = [lay.workers[wi][0] for wi in lay.node_worker]
    duration = [0.0] * n
    dep = [-1] * n
    delay = [0.0] * n
    opt_deps: dict[int, list[int]] = {}
    last_back = [-1] * len(lay.workers)  # last W/BW node per worker
    peers: dict[int, list[int]] = {}
    for wi, (_, s) in enumerate(lay.workers):
        peers.setdefault(s, []).append(wi)
        for j in range(lay.first[wi + 1] - 1, lay.first[wi] - 1, -1):
            if lay.node_op[j] in (OP_W, OP_BW):
                last_back[wi] = j
                break
    f_node, back_node, node_op, node_key, first = (
        lay.f_node,
        lay.back_node,
        lay.node_op,
        lay.node_key,
        lay.first,
    )
    for wi, (d, s) in enumerate(lay.workers):
        times = [x * lay.factor[wi] for x in base[s]]
        has_next = s < num_p - 1
        for j in range(first[wi], first[wi + 1]):
            op = node_op[j]
            duration[j] = times[op]
            key = node_key[j]
            if op == OP_F:
                if s > 0:
                    p = f_node[key - stride]
                    dep[j] = p
                    delay[j] = act_ms if pipe[p] == d else cross_ms
            elif op in (OP_B, OP_BW):
                if has_next:
                    p = back_node[key + stride]
                    dep[j] = p
                    delay[j] = act_ms if pipe[p] == d else cross_ms
                else:
                    dep[j] = f_node[key]
            elif op == OP_W:
                dep[j] = back_node[key]  # a W's mb has a B, not a BW (structure check)
            else:
                dep[j] = _MULTI
                delay[j] = job.allreduce_ms(s)
                opt_deps[j] = [last_back[q] for q in peers[s] if last_back[q] >= 0]
    return Graph(duration=duration, dep=dep, delay=delay, opt_deps=opt_deps)


def topological_order(lay: Layout, graph: Graph) -> list[int]:
    """A dependency-respecting order of one iteration's nodes; ScheduleRuleError('deadlock') if none.

    Each worker runs its order as far as its dependencies allow; a worker that meets an op whose
    dependency has not run yet parks on that dependency and is resumed when it runs.
    """
    n = lay.num_nodes
    dep, opt_deps, first = graph.dep, graph.opt_deps, lay.first
    done = [False] * n
    parked: list[list[int] | None] = [None] * n  # node -> workers waiting for it
    pos = first[:-1]
    seen: dict[int, int] = {}  # OPT node -> how many of its opt_deps are known done (done only grows)
    stack = list(range(len(lay.workers) - 1, -1, -1))
    order: list[int] = []
    while stack:
        wi = stack.pop()
        j, stop = pos[wi], first[wi + 1]
        while j < stop:
            p = dep[j]
            if p == _MULTI:  # the first peer not done yet, resuming where the last look stopped
                peers = opt_deps[j]
                i = seen.get(j, 0)
                while i < len(peers) and done[peers[i]]:
                    i += 1
                seen[j] = i
                p = peers[i] if i < len(peers) else -1
            if p >= 0 and not done[p]:
                waiting = parked[p]
                if waiting is None:
                    parked[p] = [wi]
                else:
                    waiting.append(wi)
                break
            done[j] = True
            order.append(j)
            waiting = parked[j]
            if waiting is not None:
                stack.extend(waiting)
            j += 1
        pos[wi] = j
    if len(order) < n:
        raise ScheduleRuleError("deadlock", _deadlock_message(lay, graph, done))
    return order


def _deadlock_message(lay: Layout, graph: Graph, done: list[bool]) -> str:
    stuck: list[str] = []
    for i in range(len(lay.workers)):
        head = next((j for j in range(lay.first[i], lay.first[i + 1]) if not done[j]), None)
        if head is None:
            continue
        p = graph.dep[head]
        deps = graph.opt_deps[head] if p == _MULTI else [p] if p >= 0 else []
        blockers = [lay.describe(q) for q in deps if not done[q]]
        d, s = lay.workers[i]
        stuck.append(f"worker [{d}, {s}] at {lay.describe(head)} waits on {' and '.join(blockers)}")
    named = "; ".join(stuck[:_MAX_STUCK_NAMED])
    more = f"; and {len(stuck) - _MAX_STUCK_NAMED} more" if len(stuck) > _MAX_STUCK_NAMED else ""
    return f"the orders deadlock ({len(stuck)} workers stuck): {named}{more}"


def replay(job: JobSpec, scenario: FailureScenario, schedule: Schedule, num_iterations: int = 4) -> Replay:
    """Check the schedule's structure, then replay its orders for `num_iterations` iterations.

    Raises ScheduleRuleError for a broken structure rule or a deadlocking order (rule 'deadlock',
    naming the stuck workers and what each waits on), InvalidInputError when num_iterations < 4.
    """
    _check_iterations(num_iterations)
    if schedule.partition_ranges() is not None:  # re-partitioned (issue 12): its stage-level job
        from planner.partition import job_for_schedule

        job = job_for_schedule(job, schedule)
    return _replay_layout(job, check_structure(job, scenario, schedule), num_iterations, with_memory=True)


def _check_iterations(num_iterations: int) -> None:
    if isinstance(num_iterations, bool) or not isinstance(num_iterations, int):
        raise InvalidInputError(f"num_iterations: must be an integer, got {num_iterations!r}")
    if num_iterations < MIN_ITERATIONS:
        raise InvalidInputError(f"num_iterations: must be at least {MIN_ITERATIONS}, got {num_iterations}")


def _replay_layout(job: JobSpec, lay: Layout, num_iterations: int, with_memory: bool) -> Replay:
    graph = build_graph(job, lay)
    clock = _Clock(lay, graph, topological_order(lay, graph))
    starts, ends, opt_ends = [], [], []
    for _ in range(num_iterations):
        start, end = clock.iteration()
        starts.append(start)
        ends.append(end)
        opt_ends.append(list(clock.free))  # every worker's last op is its OPT
    last_opt = [max(x) for x in opt_ends]
    k_time = (last_opt[-1] - last_opt[0]) / (num_iterations - 1)
    steady = settle(opt_ends, clock.opt_ends)
    if with_memory:
        at_start, at_end = memory_deltas(job, lay)
        peaks = dict(
            zip(lay.workers, peak_memory(lay, at_start, at_end, graph.duration, starts, ends), strict=True)
        )
    else:
        peaks = {}
    first_times: dict[WorkerKey, list[tuple[float, float]]] = {}
    busy: dict[WorkerKey, float] = {}
    start1, end1 = starts[0], ends[0]
    for i, w in enumerate(lay.workers):
        a, b = lay.first[i], lay.first[i + 1]
        first_times[w] = list(zip(start1[a:b], end1[a:b], strict=True))
        busy[w] = sum(graph.duration[a:b])
    log.debug(
        "replayed %d nodes x %d iterations: %.6f ms (K=%d: %.6f ms)",
        lay.num_nodes,
        steady.iterations,
        steady.iteration_time_ms,
        num_iterations,
        k_time,
    )
    return Replay(
        iteration_time_ms=steady.iteration_time_ms,
        first_iteration_times=first_times,
        peak_memory_mib=peaks,
        busy_ms=busy,
        num_iterations=num_iterations,
        last_opt_end_ms=last_opt,
        replayed_opt_end_ms=[max(x) for x in opt_ends],  # settle() extended opt_ends in place
        k_iteration_ms=k_time,
        steady=steady,
    )


def replay_orders(
    job: JobSpec,
    scenario: FailureScenario,
    orders: dict[WorkerKey, list[tuple[str, tuple[int, int] | None]]],
    num_iterations: int = 4,
    with_memory: bool = False,
) -> Replay:
    """`replay` of the schedule whose workers run `orders` (each ending with ("OPT", None)), listed
    by stage then pipeline as planner.orders.to_schedule lists them, without building the schedule
    document: the same structure checks (check_orders), the same times. For callers that only want
    the figures of many large schedules (whatif's baselines). Peak memory is computed only
    `with_memory` (else peak_memory_mib is empty)."""
    _check_iterations(num_iterations)
    listing = [(w, orders[w]) for w in sorted(orders, key=lambda w: (w[1], w[0]))]
    lay = check_orders(job, scenario, listing)
    return _replay_layout(job, lay, num_iterations, with_memory=with_memory)


class _Clock:
    """Replays iterations one after another: each op starts when its worker is free and its
    dependencies (plus delay) have ended. `free` is each worker's last end (its OPT's, between
    iterations)."""

    def __init__(self, lay: Layout, graph: Graph, order: list[int]) -> None:
        wk, dur, dep, delay, opt_deps = (
            lay.node_worker,
            graph.duration,
            graph.dep,
            graph.delay,
            graph.opt_deps,
        )
        # Each node's fields in evaluation order, read once rather than once per iteration.
        self.steps = [(j, wk[j], dep[j], delay[j], dur[j], opt_deps.get(j)) for j in order]
        self.free = [0.0] * len(lay.workers)
        self.num_nodes = lay.num_nodes

    def iteration(self) -> tuple[list[float], list[float]]:
        """Start and end of every node in the next iteration."""
        free = self.free
        start = [0.0] * self.num_nodes
        end = [0.0] * self.num_nodes
        for j, w, p, lag, length, peers in self.steps:
            t = free[w]
            if p >= 0:
                x = end[p] + lag
                if x > t:
                    t = x
            elif peers is not None:  # an OPT (p == _MULTI)
                for q in peers:
                    x = end[q] + lag
                    if x > t:
                        t = x
            start[j] = t
            t += length
            end[j] = t
            free[w] = t
        return start, end

    def opt_ends(self) -> list[float]:
        """Replay the next iteration; every worker's OPT end in it."""
        self.iteration()
        return list(self.free)
