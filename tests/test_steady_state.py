"""Steady-state claims (planner/simulator/steady.py): the claimed iteration time is the limit of the
K-iteration figure, checked by hand, against an exact max-cycle-mean oracle, and in the validator."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import ScheduleRuleError
from planner.plan import plan
from planner.simulator import replay, validate
from planner.simulator.engine import _Clock, build_graph, topological_order
from planner.simulator.steady import find_period, settle
from planner.simulator.structure import check_structure
from tests.strategies import recoverable_scenarios, small_jobs
from tests.test_simulator_structure import make_schedule

# D=2, P=2, M=1, worker [0,0] failed. Stage 0: F=B=W=1, OPT 0; stage 1: F 3, B 2, W 1, OPT 4;
# all-reduce 1 ms, hops free. OPT ends per iteration, workers ([1,0], [0,1], [1,1]):
#   1: [1,0] F00 0-1 F10 1-2; [1,1] F00 1-4 B00 4-6 W00 6-7; [0,1] F10 2-5 BW10 5-8;
#      stage 1 OPT 8+1 = 9-13; [1,0] BW00 6-8 BW10 8-10 OPT 11      -> (11, 13, 13)
#   2: [1,0] F00 11-12 F10 12-13; [1,1] F00 13-16 B00 -18 W00 -19; [0,1] F10 13-16 BW10 -19;
#      OPT 20-24; [1,0] BW00 18-20 BW10 20-22 OPT 23                 -> (23, 24, 24)
#   3: (34, 36, 36); 4: (46, 47, 47). The latest OPT ends at 13, 24, 36, 47: the time per iteration
#   alternates 11, 12 (iteration 3 repeats iteration 1 shifted by 23), so the K=4 figure is
#   34/3 = 11.333 while every longer replay tends to 11.5.
ALTERNATING = {
    (1, 0): "F00 F10 BW00 BW10 OPT",
    (0, 1): "F10 BW10 OPT",
    (1, 1): "F00 B00 W00 OPT",
}
ALT_FAILED = [(0, 0)]


def alternating_job(
    stages: list[tuple[float, float, float, float]] | None = None, allreduce_ms: float = 1.0, hop: float = 0.0
) -> JobSpec:
    """The job of ALTERNATING; `stages` (F, B, W, OPT per stage) and the comm times can be varied."""
    stages = stages or [(1.0, 1.0, 1.0, 0.0), (3.0, 2.0, 1.0, 4.0)]
    return JobSpec.model_validate(
        {
            "name": "tiny",
            "num_pipelines": 2,
            "num_stages": 2,
            "num_microbatches": 1,
            "stages": [
                {"forward": f, "backward_input": b, "backward_weight": w, "optimizer": o}
                | {"activation_mib": 100.0, "weight_grad_mib": 40.0}
                for f, b, w, o in stages
            ],
            "comm": {"activation_ms": hop, "cross_pipeline_ms": 2 * hop, "allreduce_ms": allreduce_ms},
        }
    )


def test_hand_computed_alternation() -> None:
    job, scenario = alternating_job(), FailureScenario(failed=ALT_FAILED)
    result = replay(job, scenario, make_schedule(ALTERNATING, failed=ALT_FAILED))
    assert result.last_opt_end_ms == [pytest.approx(x) for x in (13.0, 24.0, 36.0, 47.0)]
    assert result.k_iteration_ms == pytest.approx(34.0 / 3)
    assert result.iteration_time_ms == pytest.approx(11.5)
    assert result.steady.period == 2 and result.steady.settled
    long = replay(job, scenario, make_schedule(ALTERNATING, failed=ALT_FAILED), num_iterations=49)
    assert long.k_iteration_ms == pytest.approx(11.5)  # 48 increments: 24 of 11 and 24 of 12
    assert long.iteration_time_ms == pytest.approx(11.5)


def test_validator_checks_the_steady_claim_and_reports_the_drift() -> None:
    job, scenario = alternating_job(), FailureScenario(failed=ALT_FAILED)
    report = validate(job, scenario, make_schedule(ALTERNATING, failed=ALT_FAILED, iteration_time_ms=11.5))
    assert report.iteration_time_ms == pytest.approx(11.5)
    assert report.k_iteration_ms == pytest.approx(34.0 / 3)
    assert report.drift == pytest.approx(11.5 / (34.0 / 3) - 1)
    assert report.to_dict()["steady_period"] == 2
    # CONTRACT.md section 4 defines the iteration time at any K >= 4: an external author who
    # replayed K = 4 and names no K claims a valid figure; the drift is reported, not refused.
    k4 = make_schedule(ALTERNATING, failed=ALT_FAILED, iteration_time_ms=34.0 / 3)
    assert validate(job, scenario, k4).drift == pytest.approx(11.5 / (34.0 / 3) - 1)
    assert validate(job, scenario, k4, num_iterations=6).iteration_time_ms == pytest.approx(11.5)
    k8 = make_schedule(ALTERNATING, failed=ALT_FAILED, iteration_time_ms=(93.0 - 13) / 7)
    validate(job, scenario, k8)  # K = 8 (ends 13, 24, 36, 47, 59, 70, 82, 93): past the replayed ones
    # A figure no K gives is refused, naming the steady state and the K = 4 figure.
    off = make_schedule(ALTERNATING, failed=ALT_FAILED, iteration_time_ms=11.45)
    with pytest.raises(ScheduleRuleError, match=r"steady state is 11\.5.*at K=4") as info:
        validate(job, scenario, off)
    assert info.value.rule == "claim"
    # A document that names the K it measured is held to that K.
    k4.replay_iterations = 4
    assert validate(job, scenario, k4, num_iterations=6).k_iteration_ms == pytest.approx(57.0 / 5)
    k4.replay_iterations = 5  # K = 5 gives (59 - 13) / 4 = 11.5, not 34 / 3
    with pytest.raises(ScheduleRuleError, match="claim"):
        validate(job, scenario, k4)


def test_find_period_and_the_cap() -> None:
    assert find_period([[0.0, 1.0], [5.0, 7.0], [10.0, 11.0]]) == (2, 10.0)
    assert find_period([[0.0, 1.0], [5.0, 6.0]]) == (1, 5.0)
    assert find_period([[0.0, 1.0]]) is None
    # OPT ends that never repeat: x(k) = (10k, 10k + sqrt(k)). The cap stops it with an estimate.
    history = [[0.0, 0.0]]
    steps = iter(range(1, 10_000))

    def step() -> list[float]:
        k = next(steps)
        return [10.0 * k, 10.0 * k + math.sqrt(k)]

    found = settle(history, step, max_iterations=40)
    assert not found.settled and found.period == 0 and found.iterations == 40
    assert found.iteration_time_ms == pytest.approx(10.0, rel=1e-2)


# ------------------------------------------------ exact oracle: the maximum cycle mean (Karp)


def one_iteration_matrix(job: JobSpec, scenario: FailureScenario, schedule: Schedule) -> list[list[float]]:
    """a[w][v]: the longest path from worker v being free to worker w's OPT end, in one iteration
    (-inf when there is none): iteration k+1's OPT ends are max_v a[w][v] + x_v(k)."""
    lay = check_structure(job, scenario, schedule)
    graph = build_graph(job, lay)
    order = topological_order(lay, graph)
    n = len(lay.workers)
    cols = []
    for v in range(n):
        clock = _Clock(lay, graph, order)
        clock.free = [0.0 if u == v else -math.inf for u in range(n)]
        cols.append(clock.opt_ends())
    return [[cols[v][w] for v in range(n)] for w in range(n)]


def max_cycle_mean(a: list[list[float]]) -> float:
    """Karp's theorem (maximum version) with a super source linked to every node by 0-weight arcs."""
    n = len(a) + 1  # nodes with the source
    d = [[0.0] * (n - 1)]  # walks of one arc: the source's
    for _ in range(n - 1):
        prev = d[-1]
        d.append([max(prev[u] + a[v][u] for u in range(n - 1)) for v in range(n - 1)])
    best = -math.inf
    for v in range(n - 1):
        if d[-1][v] == -math.inf:
            continue
        best = max(best, min((d[-1][v] - d[k][v]) / (n - 1 - k) for k in range(n - 1) if d[k][v] > -math.inf))
    return best


def test_oracle_on_the_alternation() -> None:
    job, scenario = alternating_job(), FailureScenario(failed=ALT_FAILED)
    a = one_iteration_matrix(job, scenario, make_schedule(ALTERNATING, failed=ALT_FAILED))
    assert max_cycle_mean(a) == pytest.approx(11.5)


@settings(max_examples=150, deadline=None)
@given(
    stages=st.lists(st.tuples(*[st.integers(0, 8).map(lambda x: x / 2)] * 4), min_size=2, max_size=2),
    allreduce_ms=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    hop=st.sampled_from([0.0, 0.25]),
)
def test_claims_are_the_limit_on_the_alternating_family(
    stages: list[tuple[float, float, float, float]], allreduce_ms: float, hop: float
) -> None:
    """ALTERNATING's orders with other durations: periods 1 and 2, all checked against Karp."""
    job, scenario = alternating_job(stages, allreduce_ms, hop), FailureScenario(failed=ALT_FAILED)
    schedule = make_schedule(ALTERNATING, failed=ALT_FAILED)
    result = replay(job, scenario, schedule)
    exact = max_cycle_mean(one_iteration_matrix(job, scenario, schedule))
    assert result.iteration_time_ms == pytest.approx(exact, rel=1e-9, abs=1e-9)


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_claims_are_the_limit(data: st.DataObject) -> None:
    """Planned schedules of random small jobs and failure sets: the claim is the exact growth rate
    of the replay (max cycle mean of the one-iteration map) and what a K=48 replay settles to."""
    job = data.draw(small_jobs(max_d=3, max_p=4, max_m=4))
    scenario = data.draw(recoverable_scenarios(job))
    schedule = plan(job, scenario, use_cpsat=False).schedule
    claim = schedule.iteration_time_ms
    exact = max_cycle_mean(one_iteration_matrix(job, scenario, schedule))
    assert claim == pytest.approx(exact, rel=1e-9, abs=1e-9)
    # Transients can be long (a D=1, P=3 job with a slow worker settles after 47 iterations: a
    # second cycle of the max-plus map close to the critical one), so replay well past them.
    n = 128
    long = replay(job, scenario, schedule, num_iterations=n)
    assert long.steady.settled and long.steady.iterations < n
    tail = n - long.steady.iterations
    window = tail - tail % long.steady.period  # whole periods at the end of the long replay
    ends = long.last_opt_end_ms
    assert window > 0
    assert claim == pytest.approx((ends[-1] - ends[-1 - window]) / window, rel=1e-9, abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(1, 5))
def test_settle_finds_the_max_cycle_mean_of_random_maps(data: st.DataObject, n: int) -> None:
    """`settle` on random irreducible max-plus maps (what one iteration is: planner/simulator/steady.py),
    where periods 1 to 5 are common: the rate it finds is Karp's maximum cycle mean."""
    weight = st.integers(0, 9).map(lambda x: x / 2)
    a = [[data.draw(st.one_of(st.just(-math.inf), weight)) for _ in range(n)] for _ in range(n)]
    ring = data.draw(st.permutations(range(n)))
    for i in range(n):  # a cycle through every node keeps the map irreducible
        a[ring[(i + 1) % n]][ring[i]] = data.draw(weight)
    x = [0.0] * n

    def step() -> list[float]:
        x[:] = [max(a[w][v] + x[v] for v in range(n)) for w in range(n)]
        return list(x)

    found = settle([step()], step)
    assert found.settled
    assert found.iteration_time_ms == pytest.approx(max_cycle_mean(a), rel=1e-9, abs=1e-9)


def test_validate_command_prints_the_drift(tmp_path: Path) -> None:
    """`recycle validate` on the alternating schedule: an old-style K=4 claim is valid and its drift
    shown; without `replay_iterations` it is still valid (any K >= 4), a figure no K gives is not
    (exit 4)."""
    job_path, sched_path = tmp_path / "job.json", tmp_path / "s.json"
    job_path.write_text(alternating_job().model_dump_json())
    schedule = make_schedule(ALTERNATING, failed=ALT_FAILED, iteration_time_ms=34.0 / 3)
    schedule.replay_iterations = 4
    sched_path.write_text(schedule.model_dump_json())
    cmd = [sys.executable, "-m", "recycle_cli", "validate", str(job_path), str(sched_path)]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "VALID" in ok.stdout and "iteration time at K=4 (ms)" in ok.stdout
    assert "+1.4706% (repeats every 2 iteration(s), found after" in ok.stdout
    schedule.replay_iterations = None
    sched_path.write_text(schedule.model_dump_json())
    external = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert external.returncode == 0 and "+1.4706%" in external.stdout, external.stdout
    schedule.iteration_time_ms = 11.45  # even K give (23m - 12) / (2m - 1), odd 11.5
    sched_path.write_text(schedule.model_dump_json())
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 4 and "INVALID" in bad.stdout and "steady state is 11.5" in bad.stdout


@settings(max_examples=60, deadline=None)
@given(
    stages=st.lists(st.tuples(*[st.integers(0, 8).map(lambda x: x / 2)] * 4), min_size=2, max_size=2),
    allreduce_ms=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    hop=st.sampled_from([0.0, 0.25]),
    k=st.integers(4, 40) | st.sampled_from([130, 1000]),
)
def test_a_claim_replayed_at_any_k_is_accepted(
    stages: list[tuple[float, float, float, float]], allreduce_ms: float, hop: float, k: int
) -> None:
    """An outside referee replays CONTRACT.md section 4 at its own K >= 4 and claims that figure:
    the validator (replaying K = 4 and the steady state) accepts it, with or without naming K."""
    job, scenario = alternating_job(stages, allreduce_ms, hop), FailureScenario(failed=ALT_FAILED)
    theirs = replay(job, scenario, make_schedule(ALTERNATING, failed=ALT_FAILED), num_iterations=k)
    claim = make_schedule(ALTERNATING, failed=ALT_FAILED, iteration_time_ms=theirs.k_iteration_ms)
    assert validate(job, scenario, claim).iteration_time_ms == pytest.approx(theirs.iteration_time_ms)
    claim.replay_iterations = k
    validate(job, scenario, claim)
