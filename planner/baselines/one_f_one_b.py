"""1F1B baseline (one forward, one backward, fused BW), and the order helpers the baselines share.

Failure-free, every worker [d, s] runs the classic Megatron 1F1B order over its pipeline's M
micro-batches: min(P-s-1, M) warm-up F, then alternating F / BW, then the draining BW, then OPT.
With failures the hosts are the naive re-route ones (`Problem.build(balanced=False)`), and a host
may serve micro-batches of several pipelines; a count-based warm-up can then deadlock. So the
order is defined by micro-batch index instead, which reduces to the classic order failure-free:

    F  of micro-batch [d, m] at stage s sorts at  2m + s
    BW of micro-batch [d, m] at stage s sorts at  2m + 2P - 1 - s          (ties: by d)

i.e. before the BW of micro-batch index m a worker has run the F of every micro-batch it hosts
with index <= m + P-s-1. Every dependency of CONTRACT.md section 4 (F at s-1 -> F at s, BW at
s+1 -> BW at s, F -> BW at P-1) raises that key by exactly 1, and each worker runs its ops in
increasing (key, d), so no wait-for cycle can form: the order is deadlock-free for ANY hosting.
A W inserted anywhere after its B, and OPT last, keep that true (nothing but OPT waits on a W).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from planner.contract import FailureScenario, JobSpec
from planner.problem import MicroBatchId, Problem, WorkerId

if TYPE_CHECKING:
    from planner.orders import OrderEntry, Orders


def hosted_microbatches(problem: Problem) -> dict[WorkerId, list[MicroBatchId]]:
    """Micro-batches each alive worker hosts, in micro-batch order (m, then d)."""
    return problem.hosted_by_worker()


def warmup_count(num_stages: int, stage: int, num_hosted: int) -> int:
    """Megatron's 1F1B warm-up: F run before the first F/BW pair, min(P - s - 1, n).

    The last stage has none (F0 BW0 F1 BW1 ...); stage 0 has P-1, so P micro-batches are in
    flight there when its first BW runs.
    """
    return max(0, min(num_stages - stage - 1, num_hosted))


def one_f_one_b_order(mbs: list[MicroBatchId], warmup: int, backward: str = "BW") -> list[OrderEntry]:
    """Count-based 1F1B over `mbs` (no OPT): `warmup` F, then F/`backward` pairs, then the drain.

    Deadlock-free when every stage of a pipeline hosts the same list (a plain pipeline).
    """
    n = len(mbs)
    w = min(warmup, n)
    order: list[OrderEntry] = [("F", mb) for mb in mbs[:w]]
    for i in range(n - w):
        order.append(("F", mbs[w + i]))
        order.append((backward, mbs[i]))
    order.extend((backward, mb) for mb in mbs[n - w :])
    return order


def interleaved_order(
    num_stages: int, stage: int, mbs: list[MicroBatchId], backward: str = "BW"
) -> list[OrderEntry]:
    """1F1B by micro-batch index (module docstring): deadlock-free for any hosting (no OPT)."""
    p, s = num_stages, stage
    keyed: list[tuple[tuple[int, int], OrderEntry]] = []
    for d, m in mbs:
        keyed.append(((2 * m + s, d), ("F", (d, m))))
        keyed.append(((2 * m + 2 * p - 1 - s, d), (backward, (d, m))))
    keyed.sort(key=lambda item: item[0])
    return [entry for _, entry in keyed]


def defer_weight_grads(
    skeleton: list[OrderEntry],
    delay: int,
    activation_mib: float = 0.0,
    weight_grad_mib: float = 0.0,
    capacity_mib: float | None = None,
) -> list[OrderEntry]:
    """Insert W into an F/B skeleton: the W of the j-th B runs right after the (j+delay)-th B.

    The W still pending after the last B run at the end. With a capacity, pending W are also run
    early, oldest first, before any op that would otherwise lift the worker's memory over it (a
    worker's memory level follows its order exactly, so this is the replay's peak). Flushing all
    pending W leaves only the skeleton's activations, so the result fits whenever the fused-BW
    order of the same skeleton fits.
    """
    out: list[OrderEntry] = []
    pending: deque[MicroBatchId] = deque()
    level = 0.0
    for op, mb in skeleton:
        assert mb is not None
        rise = activation_mib if op == "F" else weight_grad_mib - activation_mib
        if capacity_mib is not None:
            while pending and rise > 0 and level + rise > capacity_mib:
                out.append(("W", pending.popleft()))
                level -= weight_grad_mib
        out.append((op, mb))
        level += rise
        if op == "B":
            pending.append(mb)
            if len(pending) > delay:
                out.append(("W", pending.popleft()))
                level -= weight_grad_mib
    out.extend(("W", mb) for mb in pending)
    return out


def build_problem(job: JobSpec, scenario: FailureScenario) -> Problem:
    """Naive re-route hosts: a failed worker's micro-batches dealt round-robin to its alive peers."""
    return Problem.build(job, scenario, balanced=False)


def build_orders(problem: Problem) -> Orders:
    """1F1B with fused BW on every alive worker over the micro-batches it hosts, then OPT."""
    hosted = hosted_microbatches(problem)
    orders: Orders = {}
    for (d, s), mbs in hosted.items():
        orders[d, s] = [*interleaved_order(problem.num_stages, s, mbs), ("OPT", None)]
    return orders
