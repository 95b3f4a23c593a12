"""The single-worker relaxation of the memory-aware bound, solved exactly (issue 13, diagnostic).

Take one worker hosting `n` micro-batches and keep only its own constraints: its ops run one at a
time; a micro-batch's B starts at least `trip` after its F ends (the round trip through the later
stages at their fastest, `warmup_idle_ms`'s path); W follows B; an activation is held from F start
to B end and a weight gradient from B end to W end, within `capacity`; the iteration starts and
ends with an empty memory. The least time from the first F to the last W (or to the last B) over
every order of these ops is a lower bound on what the worker needs in any valid schedule, and at
least the closed-form warm-up term of `memory_bound` (which relaxes this problem further).

The micro-batches are identical here, so their Fs, Bs and Ws may be taken in one order (swap the
labels of two Bs, or two Ws: the memory profile and every delay stay valid). A state is then the
counts (F, B, W done), the clock, and the ready times of the pending Bs; the search keeps, per
state, only the labels no other label dominates (an earlier clock and no later ready time, both
clipped at the later clock). It is exact, and fast for a few activations (8 fit: under a second
for 37 micro-batches); with many it grows quickly, so `max_labels` stops it (None: no result).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.bounds import around_ms, return_trip_ms
from planner.contract import FailureScenario, JobSpec

EPS = 1e-9


@dataclass(frozen=True)
class SingleWorker:
    """One worker's relaxation: durations (ms), the round trip after its F, memory (MiB)."""

    hosted: int
    forward: float
    backward_input: float
    backward_weight: float
    trip: float  # least time from the end of a micro-batch's F to the start of its B
    activation: float
    weight_grad: float
    capacity: float


def single_worker_ms(p: SingleWorker, until: str = "W", max_labels: int = 2_000_000) -> float | None:
    """Least time from the first F to the end of the last W (`until="W"`) or the last B ("B").

    None when the search would keep more than `max_labels` labels in one step, or when the
    capacity does not hold one activation (no schedule exists)."""
    if until not in ("W", "B"):
        raise ValueError(f"until: expected 'W' or 'B', got {until!r}")
    n, f, b, w = p.hosted, p.forward, p.backward_input, p.backward_weight
    act, grad, cap = p.activation, p.weight_grad, p.capacity
    if n == 0:
        return 0.0
    if act > cap + EPS:
        return None
    layer: dict[tuple[int, int, int], list[tuple[float, tuple[float, ...]]]] = {(0, 0, 0): [(0.0, ())]}
    best = float("inf")
    for _ in range(3 * n):
        nxt: dict[tuple[int, int, int], list[tuple[float, tuple[float, ...]]]] = {}
        for (i, j, k), labels in layer.items():
            for t, ready in labels:
                moves = []
                if i < n and act * (i + 1 - j) + grad * (j - k) <= cap + EPS:
                    moves.append(((i + 1, j, k), t + f, (*ready, t + f + p.trip)))
                if j < i and act * (i - j - 1) + grad * (j + 1 - k) <= cap + EPS:
                    moves.append(((i, j + 1, k), max(t, ready[0]) + b, ready[1:]))
                if k < j:
                    moves.append(((i, j, k + 1), t + w, ready))
                for key, t2, r2 in moves:
                    if key == (n, n, n) or (until == "B" and key[1] == n):
                        best = min(best, t2)
                    else:
                        nxt.setdefault(key, []).append((t2, r2))
        if sum(len(v) for v in nxt.values()) > max_labels:
            return None
        layer = {key: _undominated(labels) for key, labels in nxt.items()}
    return None if best == float("inf") else best


def _undominated(labels: list[tuple[float, tuple[float, ...]]]) -> list[tuple[float, tuple[float, ...]]]:
    """Labels of one state that no other dominates (ready times compared clipped at the later clock)."""
    labels.sort()
    kept: list[tuple[float, tuple[float, ...]]] = []
    for t, ready in labels:
        if not any(
            t0 <= t + EPS and all(max(a, t) <= max(c, t) + EPS for a, c in zip(r0, ready, strict=True))
            for t0, r0 in kept
        ):
            kept.append((t, ready))
    return kept


def stage_relaxation(
    job: JobSpec, scenario: FailureScenario, stage: int, factor: float, hosted: int
) -> SingleWorker | None:
    """The relaxation of a worker of `stage` with slow factor `factor` hosting `hosted` micro-batches
    (None without a memory capacity: then only the load bound's terms count)."""
    cap = job.capacity_mib(stage)
    prof = job.stages[stage]
    if cap is None or prof.activation_mib <= 0:
        return None
    return SingleWorker(
        hosted=hosted,
        forward=prof.forward * factor,
        backward_input=prof.backward_input * factor,
        backward_weight=prof.backward_weight * factor,
        trip=return_trip_ms(job, scenario, stage),
        activation=prof.activation_mib,
        weight_grad=prof.weight_grad_mib,
        capacity=cap,
    )


def single_worker_bound_ms(
    job: JobSpec, scenario: FailureScenario, max_labels: int = 2_000_000
) -> float | None:
    """The memory-aware bound's per-worker terms with the warm-up idle replaced by the exact relaxation.

    For each stage whose alive peers are identical (the busiest hosts ceil(D*M / alive); stages with
    slow peers are skipped, their closed form stays in `memory_bound`): the worker's period is at
    least the relaxation to its last W plus the all-reduce and its OPT, and stage 0's cycle is at
    least `around_ms` plus the relaxation to its last B (docs/planner.md section 2). None when a
    search stops at `max_labels`; 0.0 when no stage with identical peers has a memory capacity."""
    failed = {tuple(w) for w in scenario.failed}
    num_d = job.num_pipelines
    factors = [
        {d: scenario.slow_factor((d, s)) for d in range(num_d) if (d, s) not in failed}
        for s in range(job.num_stages)
    ]
    hop = min(job.comm.activation_ms, job.comm.cross_pipeline_ms)
    around = around_ms(job, factors, hop)
    best = 0.0
    for s, peers in enumerate(factors):
        if not peers or len(set(peers.values())) != 1:
            continue
        phi = next(iter(peers.values()))
        relax = stage_relaxation(job, scenario, s, phi, -(-num_d * job.num_microbatches // len(peers)))
        if relax is None:
            continue
        own = single_worker_ms(relax, "W", max_labels)
        if own is None:
            return None
        best = max(best, own + job.allreduce_ms(s) + job.stages[s].optimizer * phi)
        if s > 0:
            to_b = single_worker_ms(relax, "B", max_labels)
            if to_b is None:
                return None
            best = max(best, around[s] + to_b)
    return best
