"""Can a failed stage's busiest peer and its last-stage worker alone force a period above the load bound?

Issue 13; docs/planner.md, "What it does not do".

    python -m bench.pair_relaxation JOB.json --failed D,S [--seconds 60] [--seed 1] [--orders]

With one failed worker [D, S] the busiest alive peer `u` of stage S hosts its own pipeline's
micro-batches and some re-routed ones; `v` is the last-stage worker of u's pipeline. The model
keeps only u and v as machines, each with its memory capacity; the stages between them and the
re-routed micro-batches' round trips become fixed delays (their fastest: no queueing), and v's B
reaches u's next iteration through stage 0 (B path, W, all-reduce, OPT, F path). Micro-batches
keep the hosts the balanced allocation gives them (as the planner's do). Dropping constraints only
lowers the best period, so a period found here at the load bound shows that, on those hosts, the
pair forces no excess: no bound can come from it.

For fixed orders the period is exact: the steady state of replaying them is the maximum cycle mean
of the constraint graph, whose only edges between iterations are the two workers' wraps (last op,
all-reduce and OPT, then the next iteration's first op) and the stage-0 chain (`period`). A
simulated annealing search moves one op at a time in either order (`search`).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass

from planner.bounds import load_bound, memory_bound
from planner.cli import parse_args
from planner.cli_io import parse_worker, read_document
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError
from planner.problem import Problem

NEG = -math.inf


@dataclass(frozen=True)
class Machine:
    """One of the two workers: F/B/W durations, all-reduce + OPT, and memory (MiB)."""

    f: float
    b: float
    w: float
    wrap: float  # all-reduce and OPT after its last op
    activation: float = 0.0
    weight_grad: float = 0.0
    capacity: float = math.inf


@dataclass(frozen=True)
class Pair:
    """u hosts `own` micro-batches that go on to v and `extra` re-routed ones (tokens F/B/W and
    f/b/w in its order); v hosts the `own` ones (F/B/W)."""

    u: Machine
    v: Machine
    own: int
    extra: int
    down: float  # u's F end -> v's F start
    up: float  # v's B end -> u's B start
    extra_trip: float  # u's f end -> its b start
    chain: float  # v's B end -> u's next iteration (0: none, u is at stage 0)


def build_pair(job: JobSpec, scenario: FailureScenario) -> tuple[Pair, tuple[int, int], tuple[int, int]]:
    """The pair of one failed worker's stage (module doc), and u's and v's [d, s]."""
    if len(scenario.failed) != 1 or scenario.slow:
        raise InvalidInputError("the pair relaxation takes exactly one failed worker and no slow ones")
    prob = Problem.build(job, scenario)
    (fd, s) = scenario.failed[0]
    last = job.num_stages - 1
    if s == last:
        raise InvalidInputError(f"stage {s} is the last stage: its peers have no later saturated worker")
    hosted = prob.hosted_by_worker()
    pu = max(prob.alive[s], key=lambda d: (len(hosted[d, s]), -d))
    own = sum(1 for d, _ in hosted[pu, s] if d == pu)
    extra = len(hosted[pu, s]) - own
    hop = prob.hop_ms

    def machine(st: int) -> Machine:
        prof, cap = job.stages[st], job.capacity_mib(st)
        return Machine(
            f=prob.duration("F", pu, st),
            b=prob.duration("B", pu, st),
            w=prob.duration("W", pu, st),
            wrap=job.allreduce_ms(st) + prob.duration("OPT", pu, st),
            activation=prof.activation_mib,
            # a fused BW holds its activation to its end and no weight gradient: where the weight
            # gradient is larger, a worker may run BW instead, so the model charges no more
            weight_grad=min(prof.weight_grad_mib, prof.activation_mib),
            capacity=math.inf if cap is None else cap,
        )

    between = range(s + 1, last)
    down = sum(prob.duration("F", pu, t) for t in between) + (last - s) * hop(pu, pu)
    up = sum(prob.duration("B", pu, t) for t in between) + (last - s) * hop(pu, pu)
    trip = sum(prob.duration("F", fd, t) + prob.duration("B", fd, t) for t in range(s + 1, last + 1))
    trip += 2 * hop(pu, fd) + 2 * (last - s - 1) * hop(fd, fd)
    chain = 0.0
    if s > 0:
        chain = sum(prob.duration("B", pu, t) for t in range(last))
        chain += prob.duration("W", pu, 0) + job.allreduce_ms(0) + prob.duration("OPT", pu, 0)
        chain += sum(prob.duration("F", pu, t) for t in range(s)) + last * hop(pu, pu)
        chain += s * min(hop(pu, pu), hop(pu, fd))  # u's first op may be a re-routed micro-batch's F
    pair = Pair(machine(s), machine(last), own, extra, down, up, trip, chain)
    return pair, (pu, s), (pu, last)


def valid(m: Machine, order: str) -> bool:
    """Each micro-batch's F before its B before its W (labels in order per kind), within memory."""
    seen = dict.fromkeys("FBWfbw", 0)
    level = 0.0
    for t in order:
        seen[t] += 1
        if t in "Bb" and seen[t] > seen["F" if t == "B" else "f"]:
            return False
        if t in "Ww" and seen[t] > seen["B" if t == "W" else "b"]:
            return False
        if t in "Ff":
            level += m.activation
        elif t in "Bb":
            level += m.weight_grad - m.activation
        else:
            level -= m.weight_grad
        if level > m.capacity * (1 + 1e-9):
            return False
    return True


def period(pair: Pair, su: str, sv: str) -> float:
    """Steady-state period of replaying orders `su` (u) and `sv` (v): module doc; inf if they deadlock.

    Within an iteration the constraints form a DAG over the ops; every cycle of the full graph
    crosses iterations through edges into u's or v's first op. With C[x][y] the longest path from
    x's first op to an edge into y's first op, the period is the largest cycle mean of the two-node
    graph C (each of its edges spans one iteration)."""
    u, v = pair.u, pair.v
    n = len(su)
    node: dict[tuple[str, int], int] = {}
    dur: list[float] = []
    for base, order, mach in ((0, su, u), (n, sv, v)):
        count = dict.fromkeys("FBWfbw", 0)
        for k, t in enumerate(order):
            node[t + ("v" if base else ""), count[t]] = base + k
            count[t] += 1
            dur.append({"F": mach.f, "B": mach.b, "W": mach.w}[t.upper()])
    total = n + len(sv)
    succ: list[list[tuple[int, float]]] = [[] for _ in range(total)]
    for base, length in ((0, n), (n, len(sv))):
        for k in range(base + 1, base + length):
            succ[k - 1].append((k, dur[k - 1]))
    for i in range(pair.own):
        fu, bu, wu = node["F", i], node["B", i], node["W", i]
        fv, bv, wv = node["Fv", i], node["Bv", i], node["Wv", i]
        succ[fu].append((fv, u.f + pair.down))
        succ[fv].append((bv, v.f))
        succ[bv].append((wv, v.b))
        succ[bv].append((bu, v.b + pair.up))
        succ[bu].append((wu, u.b))
    for i in range(pair.extra):
        succ[node["f", i]].append((node["b", i], u.f + pair.extra_trip))
        succ[node["b", i]].append((node["w", i], u.b))
    indegree = [0] * total
    for edges in succ:
        for x, _ in edges:
            indegree[x] += 1
    topo = [x for x in range(total) if indegree[x] == 0]
    for x in topo:
        for y, _ in succ[x]:
            indegree[y] -= 1
            if indegree[y] == 0:
                topo.append(y)
    if len(topo) < total:
        return math.inf

    def back_edges(src: int) -> tuple[float, float]:
        dist = [NEG] * total
        dist[src] = 0.0
        for x in topo:
            if dist[x] > NEG:
                for y, wt in succ[x]:
                    dist[y] = max(dist[y], dist[x] + wt)
        to_u = dist[n - 1] + dur[n - 1] + u.wrap
        if pair.chain:
            to_u = max([to_u] + [dist[node["Bv", i]] + v.b + pair.chain for i in range(pair.own)])
        return to_u, dist[total - 1] + dur[total - 1] + v.wrap

    cuu, cuv = back_edges(0)
    cvu, cvv = back_edges(n)
    return max(cuu, cvv, (cuv + cvu) / 2)


def initial_orders(pair: Pair) -> tuple[str, str]:
    """Valid orders to start from: u runs as many Fs as its memory admits (re-routed ones spread),
    then B, W and the next F of the oldest micro-batch in flight; v runs F, B, W per micro-batch."""
    total = pair.own + pair.extra
    spread = {int((k + 0.5) * total / pair.extra) for k in range(pair.extra)} if pair.extra else set()
    fs = ["f" if k in spread else "F" for k in range(total)]
    u = pair.u
    room = max(u.capacity - max(0.0, u.weight_grad - u.activation), u.activation)
    fit = total if not math.isfinite(room) or not u.activation else int(room // u.activation)
    warm = max(1, min(total, fit))
    while True:
        order = fs[:warm]
        for k, t in enumerate(fs):
            order += ["B", "W"] if t == "F" else ["b", "w"]
            if k + warm < total:
                order.append(fs[k + warm])
        su = "".join(order)
        if valid(u, su) or warm == 1:
            return su, "FBW" * pair.own
        warm -= 1


def move(order: str, i: int, j: int) -> str:
    """`order` with its op at position i moved to position j (the search's step)."""
    rest = order[:i] + order[i + 1 :]
    return rest[:j] + order[i] + rest[j:]


def search(
    pair: Pair, seconds: float, seed: int, target: float = 0.0, report: bool = False
) -> tuple[float, str, str]:
    """Simulated annealing over the two orders (module doc): the best period and orders found
    within `seconds`, or the first at or below `target`."""
    su, sv = initial_orders(pair)
    if not (valid(pair.u, su) and valid(pair.v, sv)):
        raise InvalidInputError("no starting order fits the memory capacity")
    rng = random.Random(seed)
    current = period(pair, su, sv)
    best = (current, su, sv)
    scale = 0.003 * current if math.isfinite(current) else 1.0
    t0 = last_report = time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds and best[0] > target * (1 + 1e-9):
        temp = scale * (1 - elapsed / seconds) + 1e-6
        on_u = rng.random() < 0.6
        order, mach = (su, pair.u) if on_u else (sv, pair.v)
        i, j = rng.randrange(len(order)), rng.randrange(len(order))
        if i == j:
            continue
        moved = move(order, i, j)
        if not valid(mach, moved):
            continue
        value = period(pair, moved, sv) if on_u else period(pair, su, moved)
        if value <= current or rng.random() < math.exp((current - value) / temp):
            current = value
            su, sv = (moved, sv) if on_u else (su, moved)
            if current < best[0] - 1e-9:
                best = (current, su, sv)
        if report and time.perf_counter() - last_report > 5:
            last_report = time.perf_counter()
            print(f"  {elapsed:5.0f} s: best period {best[0]:.3f} ms", file=sys.stderr, flush=True)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pair_relaxation", description=__doc__.split("\n")[0])
    ap.add_argument("job", help="job spec JSON")
    ap.add_argument("--failed", required=True, metavar="D,S", help="the failed worker")
    ap.add_argument("--seconds", type=float, default=60.0, help="search time (default 60)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--orders", action="store_true", help="print the best orders found")
    args = parse_args(ap, argv)  # refuses `--seconds=--` (argparse would store [])
    if not args.seconds > 0 or not math.isfinite(args.seconds):
        ap.error(f"--seconds {args.seconds}: a positive number")
    try:
        failed = parse_worker(args.failed, "--failed")
    except InvalidInputError:
        ap.error(f"--failed {args.failed}: give the failed worker as D,S (e.g. 1,4)")
    try:
        job = read_document(args.job, JobSpec, "job spec")
        scenario = FailureScenario(failed=[failed])
        pair, wu, wv = build_pair(job, scenario)
    except (InvalidInputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lb = load_bound(job, scenario)
    for name, w, m, n in (("u", wu, pair.u, pair.own + pair.extra), ("v", wv, pair.v, pair.own)):
        print(
            f"{name} = {list(w)}: {n} micro-batches, busy + all-reduce + OPT "
            f"{n * (m.f + m.b + m.w) + m.wrap:.3f} ms"
        )
    mb = memory_bound(job, scenario)
    print(
        f"load bound {lb:.3f} ms, memory-aware bound {mb:.3f} ms; "
        f"searching up to {args.seconds:g} s (seed {args.seed})",
        flush=True,
    )
    t0 = time.perf_counter()
    try:
        best, su, sv = search(pair, args.seconds, args.seed, target=lb, report=True)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    print(
        f"best period {best:.3f} ms, {best / lb:.4f}x the load bound, {best / mb:.4f}x the memory-aware "
        f"bound, after {time.perf_counter() - t0:.1f} s"
    )
    if args.orders:
        print(f"u: {su}\nv: {sv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
