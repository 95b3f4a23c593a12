"""B look-ahead on stages with slack: the greedy policy that closes the adjacent-failure gaps
(docs/planner.md section 4c, issue 13).

The list scheduler is non-preemptive: a worker that starts an F (or a filler W) just before a B
arrives makes that B wait almost a whole op. On a stage whose load bound is below the job's (a
stage with slack) that wait buys nothing, and the B is on a round trip a bottleneck stage upstream
waits for: a worker whose memory holds k activations idles once its k Fs are done until its first B
is back, and with three adjacent stages saturated the busiest workers of the next two stages then
idle before their first F as well (their iteration starts with the first one's). On gpt3-13b-p8d8
[0,1] [1,2] [2,3] the first round trips of stage 1 took 97.6-103 ms for 77 ms of ops, each B waiting
3.9-5.7 ms behind an op at four or five of stages 2-6: 11.6 ms idle per iteration on every busiest
worker of stages 1-3, the whole 1.87% gap. Removing the waits at the stages with slack (4-7)
suffices: 1.0004x.

Here a worker of a slack stage holds back an F or W when a B is announced (ready times are known
once the producing op starts) to arrive within `b_patience` of its F duration, and runs the B when
it arrives. Workers of bottleneck stages never wait. Where no stage has slack (no failures, equal
stages) the policy is the default one, so the planner skips it.
"""

from __future__ import annotations

import dataclasses

from planner.adaptive.greedy import WAKE, GreedyOptions, GreedyRun, GreedySim, WorkerState, run_greedy
from planner.bounds import allocate_stage, warmup_idle_ms
from planner.contract import FailureScenario, JobSpec
from planner.problem import Problem

SLACK_TOLERANCE = 1e-9  # relative: a stage whose load bound is this far below the job's has slack


@dataclasses.dataclass(frozen=True)
class LookaheadOptions(GreedyOptions):
    """GreedyOptions plus the look-ahead of workers on slack stages (0: the default policy)."""

    b_patience: float = 0.6  # hold an F or W back when a B arrives within this many F durations


def round_trips_covered(job: JobSpec, scenario: FailureScenario) -> bool:
    """Whether every stage's memory holds enough activations to cover its round trip (the warm-up
    idle of the memory-aware bound, planner/bounds.py warmup_idle_ms, is zero everywhere)."""
    return all(warmup_idle_ms(job, scenario, s, 1.0, 10**9) <= 0 for s in range(job.num_stages))


def slack_stages(problem: Problem) -> set[int]:
    """Stages whose load bound (planner/bounds.py allocate_stage) is below the largest one."""
    job, scenario = problem.job, problem.scenario
    bounds = [allocate_stage(job, scenario, s).bound_ms for s in range(problem.num_stages)]
    top = max(bounds)
    return {s for s, b in enumerate(bounds) if b < top * (1 - SLACK_TOLERANCE)}


class LookaheadSim(GreedySim):
    def __init__(self, problem: Problem, opts: LookaheadOptions) -> None:
        self.slack = slack_stages(problem)
        self.patience = opts.b_patience
        super().__init__(problem, opts)

    def _on_wake(self, t: float, ws: WorkerState) -> None:
        if ws.s in self.slack and ws.free_at <= t and ws.iteration < self.N:
            bh = ws.ready_b.get(ws.iteration)
            if bh and t < bh[0][0] < t + self.patience * self.dur["F", ws.d, ws.s]:
                fh = ws.ready_f.get(ws.iteration)
                if ws.pending_w or (fh and fh[0][0] <= t):
                    self._push(bh[0][0], WAKE, (ws.d, ws.s))  # the B's arrival wakes it again
                    return
        super()._on_wake(t, ws)


def run_policy(problem: Problem, opts: GreedyOptions) -> GreedyRun:
    """`run_greedy`, or the look-ahead scheduler when `opts` is LookaheadOptions."""
    if isinstance(opts, LookaheadOptions) and opts.b_patience > 0:
        return LookaheadSim(problem, opts).run()
    return run_greedy(problem, opts)
