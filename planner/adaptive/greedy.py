"""Greedy list scheduler: the fast layer of the adaptive (ReCycle) planner.

It simulates several consecutive iterations under CONTRACT.md's replay rules (no global barrier: a
worker starts its next iteration right after its own OPT) and lets every worker, whenever it is free,
pick the best ready op by a fixed priority: B first (it is on the critical path and frees activation
memory), then F if memory (and the optional in-flight cap) admits it, then a deferred W. W is the
filler: deferred Ws fill the bubbles, above all the gap at the iteration boundary while upstream
stages finish their step, which is what the staggered optimizer turns into useful time.

The orders of one simulated iteration (by default the last, which is closest to the steady state)
become every worker's order. The result is always deadlock-free: the greedy only ever runs ops
whose dependencies have completed, so its own timeline is a replay of the orders it records.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from planner.errors import InvalidInputError
from planner.orders import Orders
from planner.problem import MicroBatchId, Problem, WorkerId

DONE, WAKE = 0, 1  # event kinds: completions before wake-ups at the same instant


@dataclass(frozen=True)
class GreedyOptions:
    """Knobs of the list scheduler; the planner tries a small portfolio of them."""

    num_iterations: int = 4
    inflight_extra: int | None = None  # cap in-flight activations at P - s + extra; None: memory only
    w_fill: bool = True  # run deferred Ws whenever nothing else is ready (else only under memory pressure)
    capacity_margin: float = 1.0  # fraction of the memory capacity the greedy plans to use
    w_patience: float = 0.0  # skip a filler W when a known F/B arrives within this many W durations


@dataclass
class GreedyRun:
    """Orders of every simulated iteration and the greedy's own period estimate."""

    orders_by_iteration: list[Orders]
    times_by_iteration: list[dict[WorkerId, list[tuple[float, float]]]]  # aligned with the orders
    period_estimates: list[float]  # last-OPT end differences between consecutive iterations

    def steady_orders(self) -> Orders:
        return self.orders_by_iteration[-1]


@dataclass
class WorkerState:
    """One worker's state in the simulation (subclasses of GreedySim read it in `_on_wake`)."""

    d: int
    s: int
    hosted: list[MicroBatchId]
    capacity: float
    inflight_cap: int
    iteration: int = 0
    free_at: float = 0.0
    mem: float = 0.0
    inflight: int = 0
    left: int = 0  # ops still to run in this iteration (OPT excluded)
    opt_ready: dict[int, float] = field(default_factory=dict)  # it -> when its OPT may start
    ready_b: dict[int, list[tuple[float, int, int]]] = field(default_factory=dict)  # it -> heap
    ready_f: dict[int, list[tuple[float, int, int]]] = field(default_factory=dict)
    pending_w: deque[MicroBatchId] = field(default_factory=deque)
    order: list[tuple[str, MicroBatchId | None]] = field(default_factory=list)
    times: list[tuple[float, float]] = field(default_factory=list)


class GreedySim:
    """The list scheduler's event simulation; planner/adaptive/lookahead.py and tight.py subclass it
    and override `_on_wake` (the choice of a free worker's next op)."""

    def __init__(self, problem: Problem, opts: GreedyOptions) -> None:
        self.p = problem
        self.opts = opts
        self.P = problem.num_stages
        self.N = opts.num_iterations
        self.events: list[tuple[float, int, int, tuple]] = []
        self.seq = itertools.count()
        self.workers: dict[WorkerId, WorkerState] = {}
        self.w_left: dict[tuple[int, int], int] = {}  # (s, it) -> Ws left at the stage
        self.w_last: dict[tuple[int, int], float] = {}
        self.opt_end: list[float] = [0.0] * self.N
        self.orders: list[Orders] = [{} for _ in range(self.N)]
        self.times: list[dict[WorkerId, list[tuple[float, float]]]] = [{} for _ in range(self.N)]
        self.dur: dict[tuple[str, int, int], float] = {}
        self._setup()

    def _setup(self) -> None:
        p = self.p
        job = p.job
        hosted = p.hosted_by_worker()
        for d, s in p.workers():
            cap = job.capacity_mib(s)
            prof = job.stages[s]
            if cap is not None and cap < prof.activation_mib:
                raise InvalidInputError(
                    f"memory_capacity_mib: stage {s} holds {cap} MiB, less than one micro-batch's "
                    f"activation ({prof.activation_mib} MiB); no schedule fits"
                )
            cap_eff = (
                float("inf") if cap is None else max(cap * self.opts.capacity_margin, prof.activation_mib)
            )
            extra = self.opts.inflight_extra
            self.workers[d, s] = WorkerState(
                d=d,
                s=s,
                hosted=hosted[d, s],
                capacity=cap_eff,
                inflight_cap=10**9 if extra is None else max(1, self.P - s + extra),
            )
            for op in ("F", "B", "W", "BW", "OPT"):
                self.dur[op, d, s] = p.duration(op, d, s)
        for s in range(self.P):
            for it in range(self.N):
                self.w_left[s, it] = p.num_pipelines * p.num_microbatches
                self.w_last[s, it] = 0.0

    def _push(self, t: float, kind: int, payload: tuple) -> None:
        heapq.heappush(self.events, (t, kind, next(self.seq), payload))

    def _start_iteration(self, ws: WorkerState, t: float) -> None:
        ws.left = 3 * len(ws.hosted)
        ws.ready_b.setdefault(ws.iteration, [])
        fh = ws.ready_f.setdefault(ws.iteration, [])
        if ws.s == 0:
            for d, m in ws.hosted:
                heapq.heappush(fh, (t, m, d))
        self._push(t, WAKE, (ws.d, ws.s))

    def run(self) -> GreedyRun:
        for ws in self.workers.values():
            self._start_iteration(ws, 0.0)
        while self.events:
            t, kind, _, payload = heapq.heappop(self.events)
            if kind == DONE:
                self._on_done(t, payload)
            else:
                self._on_wake(t, self.workers[payload[0], payload[1]])
        stuck = [w for w, ws in self.workers.items() if ws.iteration < self.N]
        if stuck:  # cannot happen with admissible capacities; guard the invariant loudly
            raise InvalidInputError(
                f"greedy scheduler stalled: workers {stuck[:4]} (memory capacity too small?)"
            )
        periods = [self.opt_end[i] - self.opt_end[i - 1] for i in range(1, self.N)]
        return GreedyRun(
            orders_by_iteration=self.orders, times_by_iteration=self.times, period_estimates=periods
        )

    # --- choosing -----------------------------------------------------------------------------
    def _on_wake(self, t: float, ws: WorkerState) -> None:
        if ws.free_at > t or ws.iteration >= self.N:
            return
        it = ws.iteration
        bh = ws.ready_b.get(it, [])
        fh = ws.ready_f.get(it, [])
        prof = self.p.job.stages[ws.s]
        if bh and bh[0][0] <= t:
            _, m, d = heapq.heappop(bh)
            self._begin(ws, t, self._backward_op(ws), (d, m))
            return
        f_ready = bool(fh) and fh[0][0] <= t
        if f_ready:
            fits = ws.mem + prof.activation_mib <= ws.capacity + 1e-9 and ws.inflight < ws.inflight_cap
            if fits:
                _, m, d = heapq.heappop(fh)
                ws.mem += prof.activation_mib
                ws.inflight += 1
                self._begin(ws, t, "F", (d, m))
                return
        nxt = min((h[0][0] for h in (bh, fh) if h and h[0][0] > t), default=None)
        if ws.pending_w:
            forced = f_ready or ws.left == len(ws.pending_w)
            patient = nxt is not None and nxt - t < self.opts.w_patience * self.dur["W", ws.d, ws.s]
            if forced or (self.opts.w_fill and not patient):
                self._begin(ws, t, "W", ws.pending_w.popleft())
                return
        opt_ready = ws.opt_ready.get(it)
        if ws.left == 0 and opt_ready is not None:
            if opt_ready <= t:
                self._begin(ws, t, "OPT", None)
            else:
                self._push(opt_ready, WAKE, (ws.d, ws.s))
            return
        if nxt is not None:
            self._push(nxt, WAKE, (ws.d, ws.s))

    def _backward_op(self, ws: WorkerState) -> str:
        """B, or the fused BW where the B's weight gradient would not fit: a B turns the
        micro-batch's activation into its weight gradient, which needs more memory when
        weight_grad_mib exceeds activation_mib; BW ends holding neither."""
        prof = self.p.job.stages[ws.s]
        grows = prof.weight_grad_mib - prof.activation_mib
        return "BW" if ws.mem + grows > ws.capacity + 1e-9 else "B"

    def _begin(self, ws: WorkerState, t: float, op: str, mb: MicroBatchId | None) -> None:
        end = t + self.dur[op, ws.d, ws.s]
        ws.free_at = end
        ws.order.append((op, mb))
        ws.times.append((t, end))
        self._push(end, DONE, (ws.d, ws.s, op, mb, ws.iteration))
        if mb is not None and op != "W":
            self._announce(ws, op, mb, end)

    def _announce(self, ws: WorkerState, op: str, mb: MicroBatchId, end: float) -> None:
        """Make the dependent op ready at `end` plus its hop. Its ready time is known as soon as
        this op starts, which lets the receiving worker look ahead before filling with a W."""
        p, s, it = self.p, ws.s, ws.iteration
        mb_d, m = mb
        if op == "F" and s + 1 < self.P:
            nh = p.host[s + 1, mb_d, m]
            ready = end + p.hop_ms(ws.d, nh)
            nws = self.workers[nh, s + 1]
            heapq.heappush(nws.ready_f.setdefault(it, []), (ready, m, mb_d))
            if nws.free_at <= ready:  # a busy receiver is woken by its own completion
                self._push(ready, WAKE, (nh, s + 1))
        elif op == "F":
            heapq.heappush(ws.ready_b.setdefault(it, []), (end, m, mb_d))
        elif op in ("B", "BW") and s > 0:
            ph = p.host[s - 1, mb_d, m]
            ready = end + p.hop_ms(ws.d, ph)
            pws = self.workers[ph, s - 1]
            heapq.heappush(pws.ready_b.setdefault(it, []), (ready, m, mb_d))
            if pws.free_at <= ready:
                self._push(ready, WAKE, (ph, s - 1))

    # --- completing ---------------------------------------------------------------------------
    def _on_done(self, t: float, payload: tuple) -> None:
        d, s, op, mb, it = payload
        ws = self.workers[d, s]
        p = self.p
        prof = p.job.stages[s]
        if op == "OPT":
            self.orders[it][d, s] = ws.order
            self.times[it][d, s] = ws.times
            ws.order, ws.times = [], []
            self.opt_end[it] = max(self.opt_end[it], t)
            ws.ready_b.pop(it, None)
            ws.ready_f.pop(it, None)
            ws.opt_ready.pop(it, None)
            ws.iteration += 1
            if ws.iteration < self.N:
                self._start_iteration(ws, t)
            return
        ws.left -= 2 if op == "BW" else 1
        if op == "B":
            ws.mem += prof.weight_grad_mib - prof.activation_mib
            ws.inflight -= 1
            ws.pending_w.append(mb)
        elif op == "BW":
            ws.mem -= prof.activation_mib
            ws.inflight -= 1
            self._stage_w_done(s, it, t, count=1)
        elif op == "W":
            ws.mem -= prof.weight_grad_mib
            self._stage_w_done(s, it, t, count=1)
        self._push(t, WAKE, (d, s))

    def _stage_w_done(self, s: int, it: int, t: float, count: int) -> None:
        self.w_left[s, it] -= count
        self.w_last[s, it] = max(self.w_last[s, it], t)
        if self.w_left[s, it] == 0:
            ready = self.w_last[s, it] + self.p.job.allreduce_ms(s)
            for d in self.p.alive[s]:
                self.workers[d, s].opt_ready[it] = ready
                self._push(ready, WAKE, (d, s))


def run_greedy(problem: Problem, opts: GreedyOptions | None = None) -> GreedyRun:
    """Simulate `opts.num_iterations` iterations with the list-scheduling policy; see module doc."""
    return GreedySim(problem, opts or GreedyOptions()).run()
