"""The exact single-worker relaxation (planner/bounds_single.py): equal to brute force over every
order of one worker's ops, never below the closed-form warm-up term, never above a valid schedule
(random ones: tests/test_bounds_valid.py), and reached on tiny jobs where it is tighter than
`memory_bound`."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.bounds import memory_bound
from planner.bounds_single import SingleWorker, single_worker_bound_ms, single_worker_ms
from planner.contract import FailureScenario
from planner.errors import ScheduleRuleError
from planner.simulator import validate
from tests import jobs
from tests.test_bounds_roundtrip import every_schedule
from tests.test_bounds_valid import Op, interleavings, schedule_of


def brute_force(p: SingleWorker, until: str) -> float | None:
    """Every order of the worker's labelled ops (any micro-batch order), each op as early as its
    delay allows; orders that break the capacity are skipped."""
    chains: list[list[Op]] = [[("F", (0, m)), ("B", (0, m)), ("W", (0, m))] for m in range(p.hosted)]
    best = None
    for order in interleavings(chains):
        t, used, ok, f_end, last_b = 0.0, 0.0, True, {}, 0.0
        for op, mb in order:
            if op == "F":
                used += p.activation
                if used > p.capacity + 1e-9:
                    ok = False
                    break
                t += p.forward
                f_end[mb] = t
            elif op == "B":
                t = max(t, f_end[mb] + p.trip) + p.backward_input
                used += p.weight_grad - p.activation
                if used > p.capacity + 1e-9:
                    ok = False
                    break
                last_b = t
            else:
                t += p.backward_weight
                used -= p.weight_grad
        if ok:
            value = t if until == "W" else last_b
            best = value if best is None else min(best, value)
    return best


def every_fifo_order(p: SingleWorker, until: str) -> float | None:
    """Every order of op kinds with the micro-batches taken in one order (no label is pruned)."""
    n, best = p.hosted, None

    def walk(i: int, j: int, k: int, t: float, f_end: tuple[float, ...]) -> None:
        nonlocal best
        if j == n and (until == "B" or k == n):
            best = t if best is None else min(best, t)
            return
        if i < n and p.activation * (i + 1 - j) + p.weight_grad * (j - k) <= p.capacity + 1e-9:
            walk(i + 1, j, k, t + p.forward, (*f_end, t + p.forward))
        if j < i and p.activation * (i - j - 1) + p.weight_grad * (j + 1 - k) <= p.capacity + 1e-9:
            walk(i, j + 1, k, max(t, f_end[j] + p.trip) + p.backward_input, f_end)
        if k < j:
            walk(i, j, k + 1, t + p.backward_weight, f_end)

    walk(0, 0, 0, 0.0, ())
    return best


durations = st.floats(0.5, 3.0, allow_nan=False).map(lambda x: round(x, 2))


@st.composite
def relaxations(draw: st.DrawFn, max_hosted: int) -> SingleWorker:
    return SingleWorker(
        hosted=draw(st.integers(1, max_hosted)),
        forward=draw(durations),
        backward_input=draw(durations),
        backward_weight=draw(durations),
        trip=draw(st.floats(0.0, 12.0, allow_nan=False).map(lambda x: round(x, 2))),
        activation=100.0,
        weight_grad=draw(st.sampled_from([10.0, 30.0, 60.0])),
        capacity=draw(st.sampled_from([100.0, 130.0, 160.0, 200.0, 260.0, 330.0])),
    )


@pytest.mark.timeout(120)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=relaxations(max_hosted=3), until=st.sampled_from(["W", "B"]))
def test_equals_brute_force(p: SingleWorker, until: str) -> None:
    assert single_worker_ms(p, until) == pytest.approx(brute_force(p, until))


@pytest.mark.timeout(120)
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=relaxations(max_hosted=5), until=st.sampled_from(["W", "B"]))
def test_pruning_keeps_the_optimum(p: SingleWorker, until: str) -> None:
    """The dominance pruning against every order of op kinds (micro-batches in one order)."""
    assert single_worker_ms(p, until) == pytest.approx(every_fifo_order(p, until))


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=relaxations(max_hosted=12))
def test_at_least_the_closed_form(p: SingleWorker) -> None:
    """The closed form (load plus warm-up idle: memory_bound's per-worker term) relaxes it further."""
    admitted = min(int(p.capacity // p.activation), p.hosted)
    idle = max(0.0, p.forward + p.trip - admitted * p.forward)
    value = single_worker_ms(p)
    assert value is not None
    assert value >= p.hosted * (p.forward + p.backward_input + p.backward_weight) + idle - 1e-9


def test_label_budget_gives_no_result() -> None:
    p = SingleWorker(30, 1.0, 1.0, 0.9, 20.0, 100.0, 30.0, 1600.0)
    assert single_worker_ms(p, max_labels=50) is None
    assert single_worker_ms(p) is not None


def test_no_schedule_when_one_activation_does_not_fit() -> None:
    assert single_worker_ms(SingleWorker(2, 1.0, 1.0, 1.0, 0.0, 100.0, 30.0, 90.0)) is None
    with pytest.raises(ValueError, match="until"):
        single_worker_ms(SingleWorker(2, 1.0, 1.0, 1.0, 0.0, 100.0, 30.0, 900.0), "X")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("capacity", "exact", "closed"), [(100.0, 11.0, 9.0), (130.0, 10.0, 9.0), (200.0, 8.0, 8.0)]
)
def test_reached_and_tighter_than_memory_bound(capacity: float, exact: float, closed: float) -> None:
    """1 pipeline x 2 stages x 2 micro-batches, every op 1 ms: every schedule, by brute force. With
    room for one or two activations (not both with a weight gradient), stage 0 must wait a round
    trip more than the closed form counts; the relaxation is the best schedule exactly."""
    job = jobs.uniform_job(1, 2, 2, capacity_mib=capacity)
    scenario = FailureScenario()
    times = []
    for orders in every_schedule(job):
        try:
            times.append(
                validate(
                    job, scenario, schedule_of(job, scenario, orders), check_claim=False
                ).iteration_time_ms
            )
        except ScheduleRuleError as exc:
            assert exc.rule in ("deadlock", "memory"), exc
    assert single_worker_bound_ms(job, scenario) == pytest.approx(exact)
    assert min(times) == pytest.approx(exact)
    assert memory_bound(job, scenario) == pytest.approx(closed)


def test_bench_prints_both_bounds_and_refuses_a_bad_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.single_worker import main

    path = tmp_path / "job.json"
    path.write_text(jobs.uniform_job(3, 2, 2, capacity_mib=100.0).model_dump_json())
    assert main([str(path), "--max-failures", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert [r.split(" | ")[1] for r in rows] == ["none", "[1,0]", "[1,1]"]
    assert all(float(r.split(" | ")[5]) >= 1.0 - 1e-9 for r in rows)  # never below the closed form here
    (tmp_path / "bad.json").write_text('{"num_stages": 0}')
    assert main([str(tmp_path / "bad.json")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_bench_refuses_bad_limits_and_names_a_job_without_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.single_worker import main

    good, bare = tmp_path / "job.json", tmp_path / "bare.json"
    good.write_text(jobs.uniform_job(3, 2, 2, capacity_mib=100.0).model_dump_json())
    bare.write_text(jobs.uniform_job(3, 2, 2).model_dump_json())
    for flags in (["--max-labels", "0"], ["--max-failures", "-1"]):
        with pytest.raises(SystemExit) as stop:
            main([str(good), *flags])
        assert stop.value.code == 2
        assert flags[0] in capsys.readouterr().err
    assert main([str(bare), "--max-failures", "0"]) == 0
    assert "| n/a | - |" in capsys.readouterr().out  # no capacity: nothing to relax, not a ratio of 0
    assert main([str(good), str(tmp_path / "missing.json")]) == 2  # every job is read before any row
    out = capsys.readouterr()
    assert out.out == "" and "missing.json" in out.err
