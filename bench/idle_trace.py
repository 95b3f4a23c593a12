"""Critical-path trace of a worker's middle idle gaps (`python -m bench.idle_breakdown --trace`).

In a replay every op starts at the later of its worker's previous end and its dependency's end plus
the hop (planner/simulator/engine.py). An idle gap of a worker between its first B and its OPT ends
with an op that waited for its input: for a B, the round trip of its micro-batch through the later
stages. The trace follows that op's dependencies back to the worker's own op of the same micro-batch
and lists every op on the way that started after its input had arrived: the stage, the op, what its
worker was running when the input arrived (an F, a W, a B of another micro-batch, or "idle": its
order put an op first that was not ready yet, e.g. because its memory was full) and how long it
queued. Summed over the gaps, the waits show which stage and which kind of wait makes the idle.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

from planner.contract import FailureScenario, JobSpec, Schedule
from planner.simulator.engine import _MULTI, Graph, _Clock, build_graph, topological_order
from planner.simulator.structure import OP_NAMES, Layout, check_structure

ITERATIONS = 12
MAX_STEPS = 400
EPS = 1e-9


class LastIteration(NamedTuple):
    """The last of ITERATIONS replayed iterations: op starts and ends by node, and each worker's
    free time before it (the end of its previous OPT)."""

    lay: Layout
    graph: Graph
    start: list[float]
    end: list[float]
    prev_free: list[float]


def replay_last(job: JobSpec, scenario: FailureScenario, schedule: Schedule) -> LastIteration:
    """Replay `schedule` with the referee's clock for ITERATIONS iterations; the last one."""
    lay = check_structure(job, scenario, schedule)
    graph = build_graph(job, lay)
    clock = _Clock(lay, graph, topological_order(lay, graph))
    prev_free: list[float] = []
    start: list[float] = []
    end: list[float] = []
    for _ in range(ITERATIONS):
        prev_free = list(clock.free)
        start, end = clock.iteration()
    return LastIteration(lay, graph, start, end, prev_free)


@dataclass(frozen=True)
class Wait:
    """One op (at `stage`) that queued `ms` behind the op its worker ran before it."""

    stage: int
    op: str  # the op that waited ("B", "F", ...)
    behind: str  # the op its worker was running ("F", "W", ...), or "idle" (an earlier op waited)
    ms: float


def trace_gaps(
    job: JobSpec,
    scenario: FailureScenario,
    schedule: Schedule,
    worker: tuple[int, int],
    min_gap_ms: float = 0.05,
) -> list[tuple[float, float, list[Wait]]]:
    """For each middle gap (after the first B, before the OPT) of `worker` longer than `min_gap_ms`,
    in the last of ITERATIONS replayed iterations: (gap start, gap length, the waits on its chain)."""
    lay, graph, start, end, _ = replay_last(job, scenario, schedule)
    wi = lay.workers.index(worker)
    a, b = lay.first[wi], lay.first[wi + 1]
    first_b = next(j for j in range(a, b) if OP_NAMES[lay.node_op[j]] in ("B", "BW"))
    out = []
    for j in range(first_b + 1, b - 1):
        gap = start[j] - end[j - 1]
        if gap > min_gap_ms:
            out.append((end[j - 1], gap, _walk(lay, graph, start, end, j, wi)))
    return out


def _walk(lay: Layout, graph: Graph, start: list[float], end: list[float], j: int, home: int) -> list[Wait]:
    """The waits of the round trip that ended at `j`: along its dependencies back to the home
    worker's own op of that micro-batch (its F), each op's start minus its input's arrival, and the
    op its worker was running (or "idle": its order put another op first, which waited)."""
    waits: list[Wait] = []
    node = graph.dep[j]
    for _ in range(MAX_STEPS):
        if node < 0 or lay.node_worker[node] == home:
            break
        if graph.dep[node] == -1:  # a stage-0 F: its input is the worker's previous OPT
            break
        w = lay.node_worker[node]
        ready = _dep_ready(graph, end, node)
        if start[node] > ready + EPS:
            running = [k for k in range(lay.first[w], node) if start[k] <= ready + EPS < end[k]]
            behind = OP_NAMES[lay.node_op[running[0]]] if running else "idle"
            waits.append(Wait(lay.workers[w][1], OP_NAMES[lay.node_op[node]], behind, start[node] - ready))
        node = _dep_node(graph, end, node)
    return waits


def _dep_ready(graph: Graph, end: list[float], node: int) -> float:
    p = graph.dep[node]
    if p == _MULTI:
        return max(end[q] for q in graph.opt_deps[node]) + graph.delay[node]
    return end[p] + graph.delay[node]


def _dep_node(graph: Graph, end: list[float], node: int) -> int:
    p = graph.dep[node]
    if p == _MULTI:
        return max(graph.opt_deps[node], key=lambda q: end[q])
    return int(p)


def summary(gaps: list[tuple[float, float, list[Wait]]]) -> list[str]:
    """One line per gap, then the waits summed by (stage, op, behind), largest first."""
    lines: list[str] = []
    total: defaultdict[tuple[int, str, str], float] = defaultdict(float)
    for t, gap, waits in gaps:
        chain = ", ".join(f"s{w.stage} {w.op}<{w.behind} {w.ms:.2f}" for w in waits if w.ms > 0.01)
        lines.append(f"  gap {gap:6.2f} ms at {t:9.2f}: {chain or 'no queued step (dependency chain)'}")
        for w in waits:
            total[w.stage, w.op, w.behind] += w.ms
    lines.append("  waits summed (stage, op waiting < op running):")
    for (s, op, behind), ms in sorted(total.items(), key=lambda kv: -kv[1])[:12]:
        lines.append(f"    stage {s} {op} < {behind}: {ms:.2f} ms")
    return lines
