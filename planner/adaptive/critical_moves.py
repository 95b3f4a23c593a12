"""Critical-cycle local search on a schedule's orders (issue 13 item 5, docs/planner.md section 4d).

The list scheduler decides on the spot and is non-preemptive; on llama3-405b-p16d128 (16 micro-batches
for 16 stages, so no steady phase) its plans lose time where an op on the critical cycle waits for
its worker although its inputs are there: a B queued behind an F or a filler W, the last F of a
pipeline held back behind a B at the stage before the last. The steady state is a max-plus
recurrence, so its period is the mean of a critical cycle; this search replays the orders, walks
that cycle back from the latest OPT (each op's binding predecessor: its dependency, or the op before
it on its worker), and for every op on it that waited for its worker, tries moving it earlier: to
just before the op that was running when its inputs arrived, just after it, or one place up.
Pipelines that play the same role carry copies of the same cycle, so each move is tried in three
versions (`_variants`): on every worker of the stage, its own op for the same micro-batch index moved
before its own op that the cycle's worker's lands before; on the workers of the stage with the same
op/own-micro-batch pattern; on the cycle's worker alone. A candidate is kept when the referee's steady
state improves (first improvement, moves tried by how long the op waited); the walk repeats until
nothing improves, the target is met or the budget is spent.

On the cycle's worker the move keeps the orders acyclic (the op's ancestors all ended before its
inputs arrived, so before the ops it passes ended); the copies on other workers have no such
guarantee: a deadlocking candidate is rejected by the replay, and one over the memory capacity before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from planner.errors import ScheduleRuleError
from planner.orders import OrderEntry, Orders
from planner.problem import Problem, WorkerId
from planner.simulator.engine import build_graph, replay_orders, topological_order
from planner.simulator.structure import OP_OPT, check_orders

Move = tuple[WorkerId, int, int, float]  # worker, index of the op, earliest useful index, its wait (ms)
_ITERATIONS = 8  # replayed to reach the steady state on these plans (they settle after 2-3)

__all__ = ["critical_search", "cycle_moves"]


def cycle_moves(problem: Problem, orders: Orders) -> list[Move]:
    """The ops of the critical cycle that waited for their worker, longest wait first (a stage-0 F
    waits for nothing else: not a move)."""
    listing = [(w, orders[w]) for w in sorted(orders, key=lambda w: (w[1], w[0]))]
    lay = check_orders(problem.job, problem.scenario, listing)
    graph = build_graph(problem.job, lay)
    order = topological_order(lay, graph)
    free = [0.0] * len(lay.workers)
    history = []
    for _ in range(_ITERATIONS):
        start, end, ready = [0.0] * lay.num_nodes, [0.0] * lay.num_nodes, [float("-inf")] * lay.num_nodes
        for j in order:
            w, p = lay.node_worker[j], graph.dep[j]
            if p >= 0:
                ready[j] = end[p] + graph.delay[j]
            elif j in graph.opt_deps:
                ready[j] = max(end[q] for q in graph.opt_deps[j]) + graph.delay[j]
            start[j] = max(free[w], ready[j])
            end[j] = free[w] = start[j] + graph.duration[j]
        history.append((start, end, ready))
    it = _ITERATIONS - 1
    j = max(range(lay.num_nodes), key=lambda n: history[it][1][n])
    moves: list[Move] = []
    while it >= _ITERATIONS - 3:  # walk back through the last iterations; moves from a whole one
        start, end, ready = history[it]
        w, first = lay.node_worker[j], lay.first[lay.node_worker[j]]
        if ready[j] >= start[j] - 1e-6:  # bound by a dependency
            if graph.dep[j] >= 0:
                j = graph.dep[j]
            elif j in graph.opt_deps:
                j = max(graph.opt_deps[j], key=lambda q: end[q])
            else:
                break
            continue
        if j == first:  # bound by the worker's OPT of the iteration before
            it, j = it - 1, lay.first[w + 1] - 1
            continue
        if it == _ITERATIONS - 2 and lay.node_op[j] != OP_OPT and ready[j] > float("-inf"):
            k = first
            while k < j and end[k] <= ready[j] + 1e-9:
                k += 1
            moves.append((lay.workers[w], j - first, k - first, start[j] - ready[j]))
        j -= 1
    return sorted(moves, key=lambda m: -m[3])


def _pattern(order: list[OrderEntry], d: int) -> tuple[tuple[str, bool], ...]:
    return tuple((op, mb is not None and mb[0] == d) for op, mb in order)


def _moved(order: list[OrderEntry], a: int, b: int) -> list[OrderEntry]:
    out = list(order)
    out.insert(b, out.pop(a))
    return out


def _variants(orders: Orders, w: WorkerId, idx: int, b: int) -> list[Orders]:
    """The changed workers of each version of moving op `idx` of `w` to index `b`: on every worker
    of the stage, its own op for the same micro-batch index moved before its own op that `w`'s
    lands before (when both are its own); on the workers with the same op/own pattern; on `w`."""
    order, s = orders[w], w[1]
    (op_x, mb_x), (op_z, mb_z) = order[idx], order[b]
    out: list[Orders] = []
    if mb_x is not None and mb_z is not None and mb_x[0] == w[0] == mb_z[0]:
        same: Orders = {}
        for v, o in orders.items():
            x, z = (op_x, (v[0], mb_x[1])), (op_z, (v[0], mb_z[1]))
            if v[1] == s and x in o and z in o and o.index(x) > o.index(z):
                same[v] = _moved(o, o.index(x), o.index(z))
        out.append(same)
    pattern = _pattern(order, w[0])
    out.append(
        {v: _moved(o, idx, b) for v, o in orders.items() if v[1] == s and _pattern(o, v[0]) == pattern}
    )
    out.append({w: _moved(order, idx, b)})
    unique: list[Orders] = []
    for changed in out:
        if changed and changed not in unique:
            unique.append(changed)
    return unique


def critical_search(
    problem: Problem,
    orders: Orders,
    current_ms: float,
    target_ms: float,
    budget_s: float,
    fits: Callable[[Problem, Orders], bool],
) -> tuple[Orders, float] | None:
    """Better orders and their steady-state iteration time, or None when no move paid within
    `budget_s` seconds. `fits(problem, orders)`: the memory check of the candidates."""
    t0 = time.perf_counter()
    best_ms, found = current_ms, None
    while best_ms > target_ms and time.perf_counter() - t0 < budget_s:
        improved = False
        for w, idx, k, _ in cycle_moves(problem, orders):
            for b in dict.fromkeys(x for x in (k, k + 1, idx - 1) if 0 <= x < idx):
                for changed in _variants(orders, w, idx, b):
                    if not fits(problem, changed):
                        continue
                    cand = {**orders, **changed}
                    try:
                        t = replay_orders(problem.job, problem.scenario, cand).iteration_time_ms
                    except ScheduleRuleError:
                        continue
                    if t < best_ms - 1e-6:
                        best_ms, orders, found, improved = t, cand, cand, True
                        break
                if improved:
                    break
            if improved or time.perf_counter() - t0 >= budget_s:
                break
        if not improved:
            break
    return None if found is None else (found, best_ms)
