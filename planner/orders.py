"""Orders: what every generator produces, and how they become a CONTRACT.md schedule document.

An order is a worker's list of (op, micro-batch) for one iteration, ending with ("OPT", None).
Timing is not the generators' business: `to_schedule` asks the simulator (the referee) to replay
the orders and stamps its predicted times and steady-state iteration time on the document.
"""

from __future__ import annotations

from planner.contract import Action, Schedule, WorkerSchedule
from planner.problem import MicroBatchId, Problem, WorkerId
from planner.simulator import replay

OrderEntry = tuple[str, MicroBatchId | None]
Orders = dict[WorkerId, list[OrderEntry]]


def to_schedule(problem: Problem, orders: Orders, strategy: str, num_iterations: int = 4) -> Schedule:
    """Build the schedule document for `orders` with the simulator's times stamped on it: the
    first iteration's op times and the steady-state iteration time (the limit as K grows; so the
    document names no `replay_iterations`). `num_iterations`: the K of the replay (at least 4).

    Raises ScheduleRuleError when the orders deadlock or break a structural rule.
    """
    draft = Schedule(
        job=problem.job.name,
        failed=[(w[0], w[1]) for w in problem.scenario.failed],
        slow=list(problem.scenario.slow) or None,
        iteration_time_ms=0.0,
        strategy=strategy,
        workers=[
            WorkerSchedule(
                worker=w,
                # Generators emit well-formed entries; skip per-action validation (49k actions on
                # the largest instance). The simulator checks every structural rule below.
                actions=[
                    Action.model_construct(op=op, mb=mb, start_ms=0.0, end_ms=0.0) for op, mb in orders[w]
                ],
            )
            for w in problem.workers()
        ],
    )
    result = replay(problem.job, problem.scenario, draft, num_iterations=num_iterations)
    for ws in draft.workers:
        times = result.first_iteration_times[ws.worker[0], ws.worker[1]]
        for action, (start, end) in zip(ws.actions, times, strict=True):
            action.start_ms = round(start, 6)
            action.end_ms = round(end, 6)
    draft.iteration_time_ms = result.iteration_time_ms
    return draft


def orders_of(schedule: Schedule) -> Orders:
    """The orders a schedule document carries."""
    return {
        (ws.worker[0], ws.worker[1]): [
            (a.op, (a.mb[0], a.mb[1]) if a.mb is not None else None) for a in ws.actions
        ]
        for ws in schedule.workers
    }
