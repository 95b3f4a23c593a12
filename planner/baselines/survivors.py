"""Shrink baseline (what TorchElastic-style recovery does): drop every pipeline that lost a worker.

Each micro-batch of a dropped pipeline is hosted, at EVERY stage, by one fully-alive pipeline
(dealt round-robin over the surviving pipelines), so no hop ever crosses pipelines and each
survivor is a plain pipeline over a longer micro-batch list. Survivors run the classic count-based
1F1B (fused BW, warm-up min(P-s-1, n)) over all they host, so their activation memory stays that
of failure-free 1F1B. The alive workers of dropped pipelines hold parameters and still take part
in the all-reduce: their order is just OPT.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.baselines.one_f_one_b import hosted_microbatches, one_f_one_b_order, warmup_count
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError
from planner.problem import Problem

if TYPE_CHECKING:
    from planner.orders import Orders


def build_problem(job: JobSpec, scenario: FailureScenario) -> Problem:
    """The problem with every dropped pipeline's micro-batches hosted by one survivor at all stages.

    Raises InvalidInputError when every pipeline lost a worker (nothing survives to shrink onto),
    and UnrecoverableScenarioError (from Problem.build) when some stage has no alive worker.
    """
    problem = Problem.build(job, scenario, balanced=False)
    dropped = sorted({d for d, _ in scenario.failed})
    kept = [d for d in range(job.num_pipelines) if d not in set(dropped)]
    if not kept:
        raise InvalidInputError(
            "1f1b-survivors does not apply: every pipeline lost a worker "
            f"(failed: {[list(w) for w in scenario.failed]}), so no pipeline is fully alive to "
            "take over the others' micro-batches"
        )
    k = 0
    for d in dropped:
        for m in range(job.num_microbatches):
            survivor = kept[k % len(kept)]
            k += 1
            for s in range(job.num_stages):
                problem.host[s, d, m] = survivor
    return problem


def build_orders(problem: Problem) -> Orders:
    """Classic 1F1B over each worker's hosted list; workers hosting nothing run only OPT.

    Assumes the hosting of `build_problem` (each micro-batch stays in one pipeline at every stage);
    count-based 1F1B over differing lists per stage could deadlock.
    """
    orders: Orders = {}
    for (d, s), mbs in hosted_microbatches(problem).items():
        warmup = warmup_count(problem.num_stages, s, len(mbs))
        orders[d, s] = [*one_f_one_b_order(mbs, warmup), ("OPT", None)]
    return orders
