"""Replay of CONTRACT.md section 4: hand-computed times, hops, slow workers, deadlock, memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.contract import Action, FailureScenario, JobSpec, Schedule, SlowWorker, WorkerSchedule
from planner.errors import InvalidInputError, ScheduleRuleError
from planner.simulator import replay
from tests.test_simulator_structure import VALID_2X2X2, make_job, make_schedule

# Every test job: F=1, B=1, W=1 (BW=2), OPT=0.5, activation hop 0.1, cross-pipeline hop 0.3,
# all-reduce 0.4 ms; activation 100 MiB, weight gradient 40 MiB.


def approx(x: float) -> object:
    return pytest.approx(x, abs=1e-9)


def test_hand_computed_2x2x2() -> None:
    # Both pipelines are symmetric; pipeline 0, iteration 1:
    #   [0,0]: F00 0-1, F01 1-2
    #   [0,1]: F00 1.1-2.1 (hop 0.1), BW00 2.1-4.1, F01 4.1-5.1 (ready at 2.1), BW01 5.1-7.1,
    #          OPT after 7.1 + 0.4 -> 7.5-8.0
    #   [0,0]: BW00 4.2-6.2 (4.1 + hop), BW01 7.2-9.2, OPT 9.6-10.1
    # Iteration 2 starts on [0,0] at 10.1 and is the same shifted by 10.1 ([0,1] is idle from
    # 8.0 until F00 arrives at 11.2): last OPT ends at 10.1, 20.2, 30.3, 40.4 -> T = 30.3 / 3.
    result = replay(make_job(2, 2, 2), FailureScenario(), make_schedule(VALID_2X2X2))
    assert result.iteration_time_ms == approx(10.1)
    assert result.last_opt_end_ms == [approx(10.1), approx(20.2), approx(30.3), approx(40.4)]
    assert result.first_iteration_times[0, 1] == [
        (approx(1.1), approx(2.1)),
        (approx(2.1), approx(4.1)),
        (approx(4.1), approx(5.1)),
        (approx(5.1), approx(7.1)),
        (approx(7.5), approx(8.0)),
    ]
    assert result.first_iteration_times[1, 0][-1] == (approx(9.6), approx(10.1))
    assert result.busy_ms[0, 0] == approx(6.5)
    # [0,0] holds both activations from F01's start until BW00 ends; [0,1] one at a time.
    assert result.peak_memory_mib[0, 0] == approx(200.0)
    assert result.peak_memory_mib[0, 1] == approx(100.0)
    assert result.num_iterations == 4


def test_more_iterations_same_steady_state() -> None:
    result = replay(make_job(2, 2, 2), FailureScenario(), make_schedule(VALID_2X2X2), num_iterations=7)
    assert result.iteration_time_ms == approx(10.1)
    assert len(result.last_opt_end_ms) == 7


def test_cross_pipeline_hop_uses_cross_delay() -> None:
    # D=2, P=2, M=1, [1,1] failed: [0,1] hosts micro-batch [1,0] at stage 1, re-routed.
    #   [0,0]: F00 0-1          [1,0]: F10 0-1
    #   [0,1]: F10 starts 1 + 0.3 (hosts [1,0] -> [0,1]: different pipelines) = 1.3, ends 2.3;
    #          BW10 2.3-4.3; F00 4.3-5.3 (ready at 1.1); BW00 5.3-7.3; OPT 7.7-8.2
    #   [1,0]: BW10 starts 4.3 + 0.3 = 4.6, ends 6.6     [0,0]: BW00 7.3 + 0.1 = 7.4 -> 9.4
    #   stage 0 OPT: max(6.6, 9.4) + 0.4 = 9.8 -> 10.3 on both peers; every iteration repeats
    #   shifted by 10.3.
    job = make_job(2, 2, 1)
    orders = {
        (0, 0): "F00 BW00 OPT",
        (1, 0): "F10 BW10 OPT",
        (0, 1): "F10 BW10 F00 BW00 OPT",
    }
    result = replay(job, FailureScenario(failed=[(1, 1)]), make_schedule(orders, failed=[(1, 1)]))
    assert result.first_iteration_times[0, 1][0] == (approx(1.3), approx(2.3))
    assert result.first_iteration_times[1, 0][1] == (approx(4.6), approx(6.6))
    assert result.first_iteration_times[0, 0][1] == (approx(7.4), approx(9.4))
    assert result.first_iteration_times[1, 0][2] == (approx(9.8), approx(10.3))
    assert result.iteration_time_ms == approx(10.3)


def test_slow_worker() -> None:
    # D=1, P=2, M=1, [0,1] twice as slow: F 2, BW 4, OPT 1.
    #   [0,0]: F 0-1; [0,1]: F 1.1-3.1, BW 3.1-7.1, OPT 7.5-8.5; [0,0]: BW 7.2-9.2, OPT 9.6-10.1
    #   iteration 2: [0,0] F 10.1-11.1, [0,1] F 11.2-13.2, BW -17.2, [0,0] BW 17.3-19.3,
    #   OPT 19.7-20.2 -> T = 10.1.
    job = make_job(1, 2, 1)
    scenario = FailureScenario(slow=[SlowWorker(worker=(0, 1), factor=2.0)])
    result = replay(job, scenario, make_schedule({(0, 0): "F00 BW00 OPT", (0, 1): "F00 BW00 OPT"}))
    assert result.first_iteration_times[0, 1] == [
        (approx(1.1), approx(3.1)),
        (approx(3.1), approx(7.1)),
        (approx(7.5), approx(8.5)),
    ]
    assert result.busy_ms[0, 1] == approx(7.0)
    assert result.iteration_time_ms == approx(10.1)


def test_per_stage_allreduce() -> None:
    # As test_slow_worker without the slow worker, all-reduce 0.4 at stage 0 and 3.0 at stage 1:
    #   [0,1]: F 1.1-2.1, BW 2.1-4.1, OPT 7.1-7.6; [0,0]: BW 4.2-6.2, OPT 6.6-7.1.
    #   iteration 2: [0,0] F 7.1-8.1; [0,1] F 8.2-9.2 (idle since 7.6), BW -11.2, OPT 14.2-14.7;
    #   [0,0] BW 11.3-13.3, OPT 13.7-14.2: last OPT ends 7.6, 14.7, ... -> T = 7.1.
    job = make_job(1, 2, 1, allreduce_ms=[0.4, 3.0])
    result = replay(job, FailureScenario(), make_schedule({(0, 0): "F00 BW00 OPT", (0, 1): "F00 BW00 OPT"}))
    assert result.first_iteration_times[0, 1][2] == (approx(7.1), approx(7.6))
    assert result.last_opt_end_ms[:2] == [approx(7.6), approx(14.7)]
    assert result.iteration_time_ms == approx(7.1)


def test_opt_waits_for_every_peer() -> None:
    # D=2, P=1, M=1, [1,0] three times as slow: its BW ends at 9 (F 3 + BW 6), so [0,0]'s OPT
    # starts at 9 + 0.4 although [0,0] finished its BW at 3.
    job = make_job(2, 1, 1)
    scenario = FailureScenario(slow=[SlowWorker(worker=(1, 0), factor=3.0)])
    result = replay(job, scenario, make_schedule({(0, 0): "F00 BW00 OPT", (1, 0): "F10 BW10 OPT"}))
    assert result.first_iteration_times[0, 0][2] == (approx(9.4), approx(9.9))


def test_deadlock_is_reported() -> None:
    # [0,1] runs F01 before BW00, but F01 at stage 0 comes after BW00 at stage 0, which needs
    # BW00 at stage 1: a cycle.
    job = make_job(1, 2, 2)
    orders = {(0, 0): "F00 BW00 F01 BW01 OPT", (0, 1): "F00 F01 BW00 BW01 OPT"}
    with pytest.raises(ScheduleRuleError) as info:
        replay(job, FailureScenario(), make_schedule(orders))
    assert info.value.rule == "deadlock"
    message = str(info.value)
    assert "worker [0, 1] at F [0, 1] on worker [0, 1] waits on F [0, 1] on worker [0, 0]" in message
    assert "worker [0, 0] at BW [0, 0] on worker [0, 0] waits on BW [0, 0] on worker [0, 1]" in message


def test_too_few_iterations() -> None:
    with pytest.raises(InvalidInputError):
        replay(make_job(2, 2, 2), FailureScenario(), make_schedule(VALID_2X2X2), num_iterations=3)


def test_split_backward_memory() -> None:
    # D=1, P=1, M=2: F00 0-1, F01 1-2, B00 2-3, B01 3-4, W00 4-5, W01 5-6.
    # 200 MiB during F01; at 3 micro-batch 0 trades 100 for 40 -> 140; at 4 -> 80.
    job = make_job(1, 1, 2)
    result = replay(job, FailureScenario(), make_schedule({(0, 0): "F00 F01 B00 B01 W00 W01 OPT"}))
    assert result.peak_memory_mib[0, 0] == approx(200.0)
    job = make_job(1, 1, 2, wgrad_mib=150.0)  # now B00's end raises it to 100 + 150
    result = replay(job, FailureScenario(), make_schedule({(0, 0): "F00 F01 B00 B01 W00 W01 OPT"}))
    assert result.peak_memory_mib[0, 0] == approx(300.0)  # after B01: 2 x 150


def test_memory_intervals_are_half_open() -> None:
    # Zero-time W right after its B: the weight gradient is held over [t, t), never at all.
    job = make_job(1, 1, 1, w=0.0, wgrad_mib=500.0)
    result = replay(job, FailureScenario(), make_schedule({(0, 0): "F00 B00 W00 OPT"}))
    assert result.peak_memory_mib[0, 0] == approx(100.0)


def reference_replay(
    job: JobSpec,
    scenario: FailureScenario,
    orders: dict[tuple[int, int], list[tuple[str, object]]],
    k_max: int,
) -> tuple[list[float], dict[tuple[int, int], float]] | None:
    """A slow, independent reading of section 4: sweep the workers, run whatever op is ready.

    Returns the end of the last OPT per iteration and each worker's peak memory (the level at
    every interval start, by brute force), or None when the orders deadlock.
    """
    where = {(w[1], op, mb): (w, i) for w, order in orders.items() for i, (op, mb) in enumerate(order)}
    last_back = {
        w: max((i for i, (op, _) in enumerate(o) if op in ("W", "BW")), default=-1) for w, o in orders.items()
    }
    ends: dict[tuple[int, tuple[int, int], int], float] = {}
    starts: dict[tuple[int, tuple[int, int], int], float] = {}
    free = dict.fromkeys(orders, 0.0)
    at = dict.fromkeys(orders, (0, 0))  # worker -> (iteration, position) of its next op
    f = scenario.slow_factor
    progressed = True
    while progressed:
        progressed = False
        for w, order in orders.items():
            while at[w][0] < k_max:
                k, i = at[w]
                op, mb = order[i]
                s = w[1]
                if op == "OPT":
                    deps = [
                        ((p, last_back[p]), job.allreduce_ms(s))
                        for p in orders
                        if p[1] == s and last_back[p] >= 0
                    ]
                else:
                    other = {"F": (s - 1, "F"), "B": (s + 1, "B"), "BW": (s + 1, "B"), "W": (s, "B")}[op]
                    if op in ("B", "BW") and s == job.num_stages - 1:
                        other = (s, "F")
                    deps = []
                    if 0 <= other[0] < job.num_stages:
                        names = ("B", "BW") if other[1] == "B" else ("F",)
                        (loc,) = [where[other[0], n, mb] for n in names if (other[0], n, mb) in where]
                        same = other[0] == s
                        hop = (
                            0.0
                            if same
                            else job.comm.activation_ms
                            if loc[0][0] == w[0]
                            else job.comm.cross_pipeline_ms
                        )
                        deps = [(loc, hop)]
                if any((k, *loc) not in ends for loc, _ in deps):
                    break
                start = max([free[w]] + [ends[k, *loc] + hop for loc, hop in deps])
                prof = job.stages[s]
                base = {
                    "F": prof.forward,
                    "B": prof.backward_input,
                    "W": prof.backward_weight,
                    "BW": prof.backward_input + prof.backward_weight,
                    "OPT": prof.optimizer,
                }[op]
                starts[k, w, i] = start
                free[w] = ends[k, w, i] = start + base * f(w)
                at[w] = (k + 1, 0) if i == len(order) - 1 else (k, i + 1)
                progressed = True
    if any(k < k_max for k, _ in at.values()):
        return None
    last_opt = [max(ends[k, w, len(o) - 1] for w, o in orders.items()) for k in range(k_max)]
    peaks = {}
    for w, order in orders.items():
        prof = job.stages[w[1]]
        intervals = []  # (from, to, MiB)
        for k in range(k_max):
            at_op = {(op, mb): i for i, (op, mb) in enumerate(order)}
            for (op, mb), i in at_op.items():
                if op == "F":
                    back = at_op["B", mb] if ("B", mb) in at_op else at_op["BW", mb]
                    intervals.append((starts[k, w, i], ends[k, w, back], prof.activation_mib))
                if op == "W":
                    b_end = ends[k, w, at_op["B", mb]]
                    intervals.append((b_end, ends[k, w, i], prof.weight_grad_mib))
        peaks[w] = max(
            [sum(mib for lo, hi, mib in intervals if lo <= t < hi) for t, _, _ in intervals], default=0.0
        )
    return last_opt, peaks


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    num_pipelines=st.integers(1, 3),
    num_stages=st.integers(1, 3),
    num_microbatches=st.integers(1, 3),
)
def test_matches_a_naive_reference_on_random_orders(
    data: st.DataObject, num_pipelines: int, num_stages: int, num_microbatches: int
) -> None:
    """Random hosts and random per-host interleavings (F before B before W): same deadlock verdict,
    same OPT ends and peak memory as the naive sweep."""
    # Zero durations and zero hops make ties, where half-open memory intervals matter.
    f, b, w = (data.draw(st.sampled_from([0.0, x])) for x in (1.0, 1.25, 0.5))
    hop = data.draw(st.sampled_from([0.0, 0.1]))
    job = make_job(num_pipelines, num_stages, num_microbatches, f=f, b=b, w=w, act_ms=hop, cross_ms=0.35)
    failed = {(0, s) for s in range(num_stages) if num_pipelines > 1 and data.draw(st.booleans())}
    scenario = FailureScenario(
        failed=sorted(failed), slow=[SlowWorker(worker=(num_pipelines - 1, 0), factor=1.5)]
    )
    orders: dict[tuple[int, int], list[tuple[str, object]]] = {}
    for s in range(num_stages):
        alive = [d for d in range(num_pipelines) if (d, s) not in failed]
        chains: dict[int, list[list[tuple[str, object]]]] = {d: [] for d in alive}
        for d in range(num_pipelines):
            for m in range(num_microbatches):
                host = data.draw(st.sampled_from(alive))
                ops = ["F", "B", "W"] if data.draw(st.booleans()) else ["F", "BW"]
                chains[host].append([(op, (d, m)) for op in ops])
        for d in alive:
            merged: list[tuple[str, object]] = []
            pending = [c for c in chains[d] if c]
            while pending:
                chain = pending[data.draw(st.integers(0, len(pending) - 1))]
                merged.append(chain.pop(0))
                pending = [c for c in pending if c]
            orders[d, s] = [*merged, ("OPT", None)]
    schedule = Schedule(
        job=job.name,
        failed=sorted(failed),
        iteration_time_ms=0.0,
        workers=[
            WorkerSchedule(worker=w, actions=[Action.model_validate({"op": op, "mb": mb}) for op, mb in o])
            for w, o in orders.items()
        ],
    )
    expected = reference_replay(job, scenario, orders, 4)
    if expected is None:
        with pytest.raises(ScheduleRuleError, match="deadlock"):
            replay(job, scenario, schedule)
        return
    result = replay(job, scenario, schedule)
    assert result.last_opt_end_ms == [pytest.approx(x, abs=1e-9) for x in expected[0]]
    assert result.peak_memory_mib == {w: pytest.approx(x, abs=1e-9) for w, x in expected[1].items()}
