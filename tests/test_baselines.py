"""Baseline schedule generators: structure, hand-derived iteration times, and validity under failures."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.baselines import BASELINES, baseline_schedule
from planner.baselines.one_f_one_b import (
    hosted_microbatches,
    interleaved_order,
    one_f_one_b_order,
    warmup_count,
)
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError, UnrecoverableScenarioError
from planner.orders import orders_of
from planner.problem import Problem
from planner.simulator import validate

NAMES = sorted(BASELINES)


def make_job(
    num_pipelines: int,
    num_stages: int,
    num_microbatches: int,
    comm_ms: float = 0.0,
    allreduce_ms: float = 0.5,
    optimizer_ms: float = 0.25,
    durations: list[tuple[float, float, float]] | None = None,
    weight_grad_mib: float = 3.0,
) -> JobSpec:
    """A uniform job (F = B = W = 1 ms unless `durations` gives (f, b, w) per stage), no memory cap."""
    per_stage = durations or [(1.0, 1.0, 1.0)] * num_stages
    return JobSpec.model_validate(
        {
            "name": "tiny",
            "num_pipelines": num_pipelines,
            "num_stages": num_stages,
            "num_microbatches": num_microbatches,
            "stages": [
                {
                    "forward": f,
                    "backward_input": b,
                    "backward_weight": w,
                    "optimizer": optimizer_ms,
                    "activation_mib": 10.0,
                    "weight_grad_mib": weight_grad_mib,
                }
                for f, b, w in per_stage
            ],
            "comm": {
                "activation_ms": comm_ms,
                "cross_pipeline_ms": 2 * comm_ms,
                "allreduce_ms": allreduce_ms,
            },
        }
    )


def scenario_of(failed: list, slow: list | None = None) -> FailureScenario:
    """A failure scenario from JSON-like lists (as a user would send it)."""
    return FailureScenario.model_validate({"failed": failed, "slow": slow or []})


def covers_every_microbatch(job: JobSpec, orders: dict) -> None:
    """Every (stage, micro-batch) runs exactly once as F and once as BW (or B and W), on one worker."""
    for s in range(job.num_stages):
        runs: dict[tuple[int, int], list[tuple[str, int]]] = {}
        for (d, ws), order in orders.items():
            if ws != s:
                continue
            for op, mb in order:
                if mb is not None:
                    runs.setdefault(mb, []).append((op, d))
        assert set(runs) == {(d, m) for d in range(job.num_pipelines) for m in range(job.num_microbatches)}
        for mb, ops in runs.items():
            hosts = {d for _, d in ops}
            assert len(hosts) == 1, f"stage {s} micro-batch {mb} split over {hosts}"
            kinds = sorted(op for op, _ in ops)
            assert kinds in (["BW", "F"], ["B", "F", "W"]), f"stage {s} micro-batch {mb}: {kinds}"


# --- structure -----------------------------------------------------------------------------------


def test_registry_and_unknown_name() -> None:
    assert set(BASELINES) == {"gpipe", "1f1b", "zb-h1", "naive-reroute", "1f1b-survivors"}
    with pytest.raises(InvalidInputError, match="unknown baseline"):
        baseline_schedule("pipedream", make_job(1, 2, 2), FailureScenario())


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(4, 8), (4, 2), (1, 3), (3, 3)])
def test_1f1b_warmup_counts(num_stages: int, num_microbatches: int) -> None:
    # Megatron: stage s runs min(P-s-1, M) warm-up F, then F/BW pairs, so min(P-s, M) F precede its
    # first BW (stage 0 of P=4, M=8: F0 F1 F2 | F3 BW0 F4 BW1 ...; the last stage: F0 BW0 F1 BW1 ...).
    job = make_job(2, num_stages, num_microbatches)
    orders = orders_of(baseline_schedule("1f1b", job, FailureScenario()))
    for (d, s), order in orders.items():
        assert warmup_count(num_stages, s, num_microbatches) == min(num_stages - s - 1, num_microbatches)
        leading = next(i for i, (op, _) in enumerate(order) if op != "F")
        assert leading == min(num_stages - s, num_microbatches)
        mbs = [(d, m) for m in range(num_microbatches)]
        expected = one_f_one_b_order(mbs, min(num_stages - s - 1, num_microbatches))
        assert order == [*expected, ("OPT", None)]


def test_1f1b_order_by_hand() -> None:
    mbs = [(0, m) for m in range(5)]
    order = one_f_one_b_order(mbs, warmup=2)
    assert [f"{op}{mb[1] if mb else ''}" for op, mb in order] == [
        "F0",
        "F1",
        "F2",
        "BW0",
        "F3",
        "BW1",
        "F4",
        "BW2",
        "BW3",
        "BW4",
    ]
    assert interleaved_order(4, 1, mbs) == order  # stage 1 of 4: warm-up P-s-1 = 2


def test_gpipe_order_failure_free() -> None:
    job = make_job(2, 3, 3)
    orders = orders_of(baseline_schedule("gpipe", job, FailureScenario()))
    assert orders[1, 2] == [
        *(("F", (1, m)) for m in range(3)),
        *(("BW", (1, m)) for m in range(3)),
        ("OPT", None),
    ]


def test_zb_h1_defers_w_by_stage_index() -> None:
    # ZB-H1 keeps 1F1B's F/B skeleton; stage s runs the W of its j-th B right after its (j+s)-th B.
    job = make_job(1, 4, 6)
    orders = orders_of(baseline_schedule("zb-h1", job, FailureScenario()))
    for (_, s), order in orders.items():
        skeleton = [(("BW" if op == "B" else op), mb) for op, mb in order if op != "W"]
        assert skeleton == [*one_f_one_b_order([(0, m) for m in range(6)], min(3 - s, 6)), ("OPT", None)]
        b_seen = 0
        for op, mb in order:
            if op == "B":
                b_seen += 1
            if op == "W" and b_seen < 6:
                assert mb == (0, b_seen - 1 - s)
    assert [op for op, _ in orders[0, 0]][3:9] == ["F", "B", "W", "F", "B", "W"]


def test_zb_h1_respects_memory_capacity() -> None:
    # Capacity = exactly 1F1B's 4 x 10 MiB at stage 0. Deferred W must never lift a worker above the
    # capacity or above what the fused-BW order of the same skeleton (1f1b) needs anyway.
    capped = make_job(2, 4, 8, weight_grad_mib=10.0).model_copy(update={"memory_capacity_mib": 40.0})
    uncapped = make_job(2, 4, 8, weight_grad_mib=10.0)
    rerouted = scenario_of([[1, 2]])
    unguarded = validate(uncapped, rerouted, baseline_schedule("zb-h1", uncapped, rerouted))
    assert unguarded.peak_memory_mib[0, 2] == pytest.approx(60.0)  # W pile up on the re-route host
    for failed in ([], [[1, 1]], [[1, 2]], [[1, 3]]):
        scenario = scenario_of(failed)
        zb = validate(uncapped, scenario, baseline_schedule("zb-h1", capped, scenario))
        fused = validate(uncapped, scenario, baseline_schedule("1f1b", uncapped, scenario))
        for w, peak in zb.peak_memory_mib.items():
            assert peak <= max(40.0, fused.peak_memory_mib[w])
    validate(capped, FailureScenario(), baseline_schedule("zb-h1", capped, FailureScenario()))


def test_survivors_hosting() -> None:
    job = make_job(3, 3, 4)
    scenario = scenario_of([[1, 1]])
    orders = orders_of(baseline_schedule("1f1b-survivors", job, scenario))
    assert orders[1, 0] == [("OPT", None)] and orders[1, 2] == [("OPT", None)]
    for s in range(3):
        for d in (0, 2):
            own = [mb for op, mb in orders[d, s] if op == "F" and mb is not None and mb[0] == d]
            assert len(own) == 4
    # pipeline 1's micro-batches dealt round-robin to pipelines 0 and 2, the same host at every stage
    for s in range(3):
        taken = {
            d: sorted(mb for op, mb in orders[d, s] if op == "F" and mb is not None and mb[0] == 1)
            for d in (0, 2)
        }
        assert taken == {0: [(1, 0), (1, 2)], 2: [(1, 1), (1, 3)]}
    covers_every_microbatch(job, orders)


def test_survivors_not_applicable_without_a_full_pipeline() -> None:
    job = make_job(2, 3, 2)
    with pytest.raises(InvalidInputError, match="no pipeline is fully alive"):
        baseline_schedule("1f1b-survivors", job, scenario_of([[0, 0], [1, 2]]))
    with pytest.raises(UnrecoverableScenarioError):
        baseline_schedule("1f1b", job, scenario_of([[0, 1], [1, 1]]))


# --- exact iteration times, derived by hand --------------------------------------------------------


def test_gpipe_iteration_time_by_hand() -> None:
    # D=2, P=3, M=4, F=1, BW=B+W=2, hop c=0.1, all-reduce a=0.5, optimizer o=0.25, both pipelines alike.
    # Forward: stage s gets F(m) at s*(1+c) + m, so the last stage ends its F at 2*(1.1) + 4 = 6.2 and
    # its BW back-to-back at 6.2 + 4*2 = 14.2. Each stage up adds c + BW: stage 0's last BW ends at
    # 14.2 + 2*(0.1 + 2) = 18.4 = (M+P-1)(F+BW) + 2(P-1)c. Stage 0 ends last, so its OPT ends at
    # 18.4 + a + o = 19.15; the next iteration starts there with every other worker already idle, so
    # each iteration is the first one shifted: iteration time 19.15.
    job = make_job(2, 3, 4, comm_ms=0.1)
    schedule = baseline_schedule("gpipe", job, FailureScenario())
    assert schedule.iteration_time_ms == pytest.approx(19.15)
    assert validate(job, FailureScenario(), schedule).iteration_time_ms == pytest.approx(19.15)


def test_1f1b_iteration_time_by_hand() -> None:
    # No hop delay: stage s starts at s, F and BW slots chain without waits, and stage 0's last BW
    # ends at (M+P-1)(F+BW) = (4+3-1)*3 = 18; + a + o = 18.75 (same as GPipe when comm is free).
    job = make_job(2, 3, 4)
    assert baseline_schedule("1f1b", job, FailureScenario()).iteration_time_ms == pytest.approx(18.75)
    # P=2, M=4, c=0.1. Stage 0: F0 F1 BW0 F2 BW1 F3 BW2 BW3; stage 1: F0 BW0 F1 BW1 F2 BW2 F3 BW3.
    #   s0 F0 [0,1] F1 [1,2]            s1 F0 [1.1,2.1] BW0 [2.1,4.1]
    #   s0 BW0 [4.2,6.2] F2 [6.2,7.2]   s1 F1 [4.1,5.1] BW1 [5.1,7.1]
    #   s0 BW1 [7.2,9.2] F3 [9.2,10.2]  s1 F2 [7.3,8.3] BW2 [8.3,10.3]
    #   s0 BW2 [10.4,12.4]              s1 F3 [10.3,11.3] BW3 [11.3,13.3]
    #   s0 BW3 [13.4,15.4], OPT ends 15.4 + 0.5 + 0.25 = 16.15 (stage 1's ends at 14.05, earlier).
    # 1F1B pays the hop on its round trips: 0.2 more than GPipe's 15.95 here.
    job = make_job(2, 2, 4, comm_ms=0.1)
    schedule = baseline_schedule("1f1b", job, FailureScenario())
    assert schedule.iteration_time_ms == pytest.approx(16.15)
    assert baseline_schedule("gpipe", job, FailureScenario()).iteration_time_ms == pytest.approx(15.95)
    s0 = [(a.op, a.start_ms, a.end_ms) for a in schedule.workers[0].actions]
    assert s0[2] == ("BW", pytest.approx(4.2), pytest.approx(6.2))
    assert s0[-2] == ("BW", pytest.approx(13.4), pytest.approx(15.4))


def test_zb_h1_iteration_time_by_hand() -> None:
    # ZB-H1 on a uniform job without hop delay: M(F+B+W) + (P-1)(F+B-W) = 8*3 + 3*1 = 27 (vs 1F1B's 33).
    job = make_job(1, 4, 8, allreduce_ms=0.0, optimizer_ms=0.0)
    assert baseline_schedule("zb-h1", job, FailureScenario()).iteration_time_ms == pytest.approx(27.0)
    assert baseline_schedule("1f1b", job, FailureScenario()).iteration_time_ms == pytest.approx(33.0)


# --- validity under failures -----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_each_baseline_valid_failure_free_and_with_failure(name: str) -> None:
    job = make_job(3, 4, 5, comm_ms=0.05)
    for failed in ([], [[1, 2]], [[0, 0], [2, 3]]):
        scenario = scenario_of(failed)
        schedule = baseline_schedule(name, job, scenario)
        assert schedule.strategy == name
        report = validate(job, scenario, schedule)
        assert report.iteration_time_ms == pytest.approx(schedule.iteration_time_ms)
        if name != "1f1b-survivors":
            covers_every_microbatch(job, orders_of(schedule))


def recoverable_failure_sets(num_pipelines: int, num_stages: int, max_failed: int) -> list[list[list[int]]]:
    workers = [[d, s] for d in range(num_pipelines) for s in range(num_stages)]
    out = []
    for k in range(max_failed + 1):
        for combo in itertools.combinations(workers, k):
            per_stage = Counter(s for _, s in combo)
            if all(n < num_pipelines for n in per_stage.values()):
                out.append([list(w) for w in combo])
    return out


def test_every_small_failure_set_is_deadlock_free() -> None:
    # Exhaustive on a 3x3 grid: every failure set of up to 3 workers that leaves each stage alive.
    job = make_job(3, 3, 4, comm_ms=0.1)
    sets = recoverable_failure_sets(3, 3, 3)
    assert len(sets) > 100
    for failed in sets:
        scenario = scenario_of(failed)
        for name in NAMES:
            try:
                schedule = baseline_schedule(name, job, scenario)
            except InvalidInputError:
                assert name == "1f1b-survivors"
                assert {d for d, _ in failed} == {0, 1, 2}
                continue
            validate(job, scenario, schedule)


@st.composite
def jobs_and_scenarios(draw: st.DrawFn) -> tuple[JobSpec, FailureScenario]:
    num_pipelines = draw(st.integers(1, 4))
    num_stages = draw(st.integers(1, 4))
    num_microbatches = draw(st.integers(1, 6))
    dur = st.floats(0.1, 3.0, allow_nan=False)
    durations = [(draw(dur), draw(dur), draw(dur)) for _ in range(num_stages)]
    job = make_job(
        num_pipelines,
        num_stages,
        num_microbatches,
        comm_ms=draw(st.floats(0.0, 0.5)),
        allreduce_ms=draw(st.floats(0.0, 2.0)),
        durations=durations,
    )
    workers = [[d, s] for d in range(num_pipelines) for s in range(num_stages)]
    failed = draw(st.lists(st.sampled_from(workers), max_size=3, unique_by=tuple))
    per_stage = Counter(s for _, s in failed)
    failed = [w for w in failed if per_stage[w[1]] < num_pipelines]  # keep every stage alive
    slow: list[dict[str, object]] = []
    alive = [w for w in workers if w not in failed]
    if draw(st.booleans()) and alive:
        slow = [{"worker": draw(st.sampled_from(alive)), "factor": draw(st.floats(1.0, 3.0))}]
    return job, scenario_of(failed, slow)


@settings(max_examples=80, deadline=None)
@given(jobs_and_scenarios())
def test_property_every_baseline_valid(case: tuple[JobSpec, FailureScenario]) -> None:
    job, scenario = case
    for name in NAMES:
        try:
            schedule = baseline_schedule(name, job, scenario)
        except InvalidInputError:
            assert name == "1f1b-survivors"
            assert {d for d, _ in scenario.failed} == set(range(job.num_pipelines))
            continue
        validate(job, scenario, schedule)
        if name == "naive-reroute":
            orders = orders_of(schedule)
            covers_every_microbatch(job, orders)
            hosts = Problem.build(job, scenario, balanced=False).host
            for (d, s), order in orders.items():
                assert all(hosts[s, mb[0], mb[1]] == d for _, mb in order if mb is not None)


def test_hosted_microbatches_in_microbatch_order() -> None:
    job = make_job(3, 2, 3)
    problem = Problem.build(job, scenario_of([[1, 0]]), balanced=False)
    hosted = hosted_microbatches(problem)
    assert hosted[0, 0] == [(0, 0), (1, 0), (0, 1), (0, 2), (1, 2)]
    assert hosted[2, 0] == [(2, 0), (1, 1), (2, 1), (2, 2)]
    assert hosted[1, 1] == [(1, 0), (1, 1), (1, 2)]
