"""Greedy policies for tight memory (docs/planner.md section 4e).

Where a stage's memory does not cover its round trip (the `-mem1x` instances: 8 activations), the
bottleneck is a stage-0 worker: after its warm-up it must keep enough micro-batches in flight that
a B is back whenever it runs out of other work, and its last B comes one round trip after its last
F. Its B feeds nobody (stage 0 has no upstream): running it before a ready F only frees memory,
while the F starts a round trip whose B the worker will wait for. With `f_first` a stage-0 worker
runs a ready F that fits in memory before a ready B. The other knobs are the default greedy's and
the look-ahead's (planner/adaptive/lookahead.py), whose combinations this module's portfolio
(TIGHT) lists: measured on the -mem1x cases (docs/benchmarks.md, "Tight memory").
"""

from __future__ import annotations

import dataclasses
import heapq

from planner.adaptive.greedy import GreedyOptions, GreedyRun, WorkerState
from planner.adaptive.lookahead import LookaheadOptions, LookaheadSim
from planner.problem import Problem


@dataclasses.dataclass(frozen=True)
class TightOptions(LookaheadOptions):
    """LookaheadOptions plus `f_first`: stage-0 workers run a ready F that fits before a ready B."""

    b_patience: float = 0.0
    f_first: bool = False


class TightSim(LookaheadSim):
    def __init__(self, problem: Problem, opts: TightOptions) -> None:
        self.f_first = opts.f_first
        super().__init__(problem, opts)

    def _on_wake(self, t: float, ws: WorkerState) -> None:
        if self.f_first and ws.s == 0 and ws.free_at <= t and ws.iteration < self.N:
            fh = ws.ready_f.get(ws.iteration)
            prof = self.p.job.stages[0]
            fits = ws.mem + prof.activation_mib <= ws.capacity + 1e-9 and ws.inflight < ws.inflight_cap
            if fh and fh[0][0] <= t and fits:
                _, m, d = heapq.heappop(fh)
                ws.mem += prof.activation_mib
                ws.inflight += 1
                self._begin(ws, t, "F", (d, m))
                return
        super()._on_wake(t, ws)


# Tried, in this order, on the first host map where memory does not cover every round trip (after
# the default policy on every map): a sweep over w_patience x inflight_extra x b_patience x f_first
# on the nine -mem1x cases above 1% (docs/benchmarks.md, "Tight memory"), ordered so that each
# policy lowers the sum of the best ratios most. Where the memory-aware bound is the load bound (the
# bottleneck stage's own memory covers its round trip) the last two (TIGHT_LOAD_FIRST) go first:
# they were the best there, and the portfolio's budget is short there (the host-map search's share).
# The first of them runs whatever the budget (it is the old portfolio's second policy).
TIGHT: tuple[GreedyOptions, ...] = (
    TightOptions(w_patience=0.45, inflight_extra=2, f_first=True),
    TightOptions(w_patience=0.6, b_patience=0.6),
    TightOptions(w_patience=0.3, inflight_extra=0, f_first=True),
    TightOptions(w_patience=0.45, inflight_extra=1),
    TightOptions(w_patience=0.6, inflight_extra=2),
    TightOptions(w_patience=0.6, inflight_extra=2, b_patience=0.15),
    GreedyOptions(w_patience=0.3),
    TightOptions(w_patience=0.3, b_patience=0.15),
)
TIGHT_LOAD_FIRST = 2


def tight_policies(load_bound_binds: bool) -> tuple[GreedyOptions, ...]:
    """TIGHT, with its last TIGHT_LOAD_FIRST policies first where the memory-aware bound is the
    load bound."""
    if not load_bound_binds:
        return TIGHT
    return (*TIGHT[-TIGHT_LOAD_FIRST:], *TIGHT[:-TIGHT_LOAD_FIRST])  # 13b [1,4]'s best, then 6.7b's


STEP = 0.15  # the neighbourhood's step in w_patience and b_patience
MAX_EXTRA = 3  # inflight_extra above this is "no cap" (None)


def neighbours(opts: GreedyOptions) -> list[TightOptions]:
    """Policies one step from `opts` (as TightOptions): w_patience and b_patience one STEP up or
    down, inflight_extra one up or down (None is the step above MAX_EXTRA), f_first toggled. The
    portfolio hill-climbs over them from the best TIGHT policy while its budget lasts."""
    knobs = {f: getattr(opts, f) for f in GreedyOptions.__dataclass_fields__}
    here = TightOptions(
        **knobs, b_patience=getattr(opts, "b_patience", 0.0), f_first=getattr(opts, "f_first", False)
    )
    extra = here.inflight_extra
    extras = [MAX_EXTRA] if extra is None else [extra - 1, None if extra + 1 > MAX_EXTRA else extra + 1]
    out = [dataclasses.replace(here, f_first=not here.f_first)]
    out += [dataclasses.replace(here, inflight_extra=e) for e in extras if e is None or e >= 0]
    for name in ("w_patience", "b_patience"):
        v = getattr(here, name)
        out += [dataclasses.replace(here, **{name: round(x, 6)}) for x in (v - STEP, v + STEP) if x >= 0]
    return out


def run_tight(problem: Problem, opts: TightOptions) -> GreedyRun:
    """The list scheduler with the tight-memory knobs (module doc)."""
    return TightSim(problem, opts).run()
