"""The bounds (planner/bounds.py; on random schedules also planner/bounds_single.py) never exceed
the steady-state iteration time of a valid schedule: random valid schedules (random hosts, random
realizable orders, slow workers, tight memory), and every schedule of tiny instances by brute
force, where the best one also shows how tight they are."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.bounds import load_bound, memory_bound
from planner.bounds_single import single_worker_bound_ms
from planner.contract import Action, FailureScenario, JobSpec, Schedule, SlowWorker, WorkerSchedule
from planner.errors import ScheduleRuleError
from planner.simulator import validate
from tests.strategies import recoverable_scenarios, small_jobs
from tests.test_simulator_structure import make_job

Worker = tuple[int, int]
Op = tuple[str, tuple[int, int] | None]


def random_orders(job: JobSpec, scenario: FailureScenario, rng: random.Random) -> dict[Worker, list[Op]]:
    """Random hosts, then one random execution order: any op whose dependencies (CONTRACT.md
    section 4) ran may run next. The recorded per-worker orders are realizable, so they never
    deadlock; W is split from B or fused into BW at random, per micro-batch and stage."""
    num_d, num_p = job.num_pipelines, job.num_stages
    failed = set(scenario.failed)
    alive = {s: [d for d in range(num_d) if (d, s) not in failed] for s in range(num_p)}
    mbs = [(d, m) for d in range(num_d) for m in range(job.num_microbatches)]
    host = {(s, mb): (rng.choice(alive[s]), s) for s in range(num_p) for mb in mbs}
    fused = {(s, mb): rng.random() < 0.5 for s in range(num_p) for mb in mbs}
    done: set[tuple[str, int, tuple[int, int]]] = set()
    orders: dict[Worker, list[Op]] = {(d, s): [] for s in range(num_p) for d in alive[s]}
    chains = {(s, mb): ("F", "BW") if fused[s, mb] else ("F", "B", "W") for s in range(num_p) for mb in mbs}
    pending = {(op, s, mb) for (s, mb), ops in chains.items() for op in ops}

    def ready(op: str, s: int, mb: tuple[int, int]) -> bool:
        if op == "F":
            return s == 0 or ("F", s - 1, mb) in done
        if op == "W":
            return ("B", s, mb) in done
        if s == num_p - 1:
            return ("F", s, mb) in done
        return ("B", s + 1, mb) in done or ("BW", s + 1, mb) in done

    while pending:
        op, s, mb = rng.choice(sorted(x for x in pending if ready(*x)))
        pending.discard((op, s, mb))
        done.add((op, s, mb))
        orders[host[s, mb]].append((op, mb))
    for order in orders.values():
        order.append(("OPT", None))
    return orders


def schedule_of(job: JobSpec, scenario: FailureScenario, orders: dict[Worker, list[Op]]) -> Schedule:
    return Schedule(
        job=job.name,
        failed=list(scenario.failed),
        iteration_time_ms=0.0,
        workers=[
            WorkerSchedule(worker=w, actions=[Action.model_validate({"op": op, "mb": mb}) for op, mb in o])
            for w, o in orders.items()
        ],
    )


def steady_time(job: JobSpec, scenario: FailureScenario, orders: dict[Worker, list[Op]]) -> float | None:
    """The schedule's steady-state iteration time, or None when it breaks the memory capacity."""
    schedule = schedule_of(job, scenario, orders)
    try:
        return validate(job, scenario, schedule, check_claim=False).iteration_time_ms
    except ScheduleRuleError as exc:
        assert exc.rule == "memory", exc
        return None


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_bounds_hold_for_random_valid_schedules(data: st.DataObject, seed: int) -> None:
    job = data.draw(small_jobs(max_d=3, max_p=3, max_m=3))
    scenario = data.draw(recoverable_scenarios(job))
    t = steady_time(job, scenario, random_orders(job, scenario, random.Random(seed)))
    if t is None:  # over the memory capacity: not a valid schedule
        return
    assert load_bound(job, scenario) <= t * (1 + 1e-9)
    assert memory_bound(job, scenario) <= t * (1 + 1e-9)
    single = single_worker_bound_ms(job, scenario)  # planner/bounds_single.py
    assert single is not None
    assert single <= t * (1 + 1e-9)


def every_schedule(job: JobSpec, scenario: FailureScenario) -> list[dict[Worker, list[Op]]]:
    """Every schedule of a one-stage job: hosts x split/fused x every interleaving on each host."""
    alive = [d for d in range(job.num_pipelines) if (d, 0) not in scenario.failed]
    mbs = [(d, m) for d in range(job.num_pipelines) for m in range(job.num_microbatches)]
    out: list[dict[Worker, list[Op]]] = []
    for hosts in itertools.product(alive, repeat=len(mbs)):
        for fused in itertools.product((False, True), repeat=len(mbs)):
            chains: dict[int, list[list[Op]]] = {d: [] for d in alive}
            for mb, h, f in zip(mbs, hosts, fused, strict=True):
                chains[h].append([("F", mb), ("BW", mb)] if f else [("F", mb), ("B", mb), ("W", mb)])
            per_host = [list(interleavings(chains[d])) for d in alive]
            for combo in itertools.product(*per_host):
                out.append({(d, 0): [*o, ("OPT", None)] for d, o in zip(alive, combo, strict=True)})
    return out


def interleavings(chains: list[list[Op]]) -> list[list[Op]]:
    """Every merge of the chains that keeps each chain's order."""
    live = [c for c in chains if c]
    if not live:
        return [[]]
    out: list[list[Op]] = []
    for i, chain in enumerate(live):
        rest = [*live[:i], chain[1:], *live[i + 1 :]]
        out.extend([chain[0], *tail] for tail in interleavings(rest))
    return out


@pytest.mark.parametrize(
    ("num_pipelines", "num_microbatches", "scenario", "capacity"),
    [
        (2, 1, FailureScenario(slow=[SlowWorker(worker=(0, 0), factor=2.0)]), None),  # slow OPT: host 0
        (2, 1, FailureScenario(slow=[SlowWorker(worker=(1, 0), factor=1.5)]), None),
        (2, 1, FailureScenario(failed=[(1, 0)]), None),
        (2, 1, FailureScenario(), 150.0),  # one activation at a time per worker
        (1, 2, FailureScenario(), 150.0),
    ],
)
def test_bounds_against_every_schedule(
    num_pipelines: int, num_microbatches: int, scenario: FailureScenario, capacity: float | None
) -> None:
    """Brute force on one-stage jobs: both bounds are at most the best schedule; with one stage
    the load bound is reached (the best host split, no warm-up round trip)."""
    job = make_job(num_pipelines, 1, num_microbatches, capacity=capacity)
    times = [t for o in every_schedule(job, scenario) if (t := steady_time(job, scenario, o)) is not None]
    best = min(times)
    assert memory_bound(job, scenario) <= best * (1 + 1e-9)
    assert load_bound(job, scenario) == pytest.approx(best)
