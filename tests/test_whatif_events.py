"""Event-driven accounting against hand-computed timelines, and unrecoverable scenarios.

Fixed strategies make the rates round: D*M = 4 micro-batches per iteration, 4000 ms per iteration
is 1 micro-batch per second. Costs: checkpoint 10 s every 100 s of training, restart 50 s,
re-route 6 s. Trace: worker [0, 1] fails at 50 s and re-joins at 150 s; 300 s run.
"""

from __future__ import annotations

import pytest

from planner.contract import FailureScenario
from tests.jobs import uniform_job
from whatif.events import simulate
from whatif.strategies import CheckpointRestart, Costs, Outcome, Strategy, make_strategies
from whatif.trace import FAIL, REJOIN, Event, generate_trace

JOB = uniform_job(2, 2, 2, optimizer_ms=0.0, activation_mib=1.0, weight_grad_mib=1.0)
COSTS = Costs(checkpoint_s=10, restart_s=50, reroute_s=6, reconfig_s=6)
TRACE = [Event(50.0, (0, 1), FAIL), Event(150.0, (0, 1), REJOIN)]


class Fixed(Strategy):
    """Iteration time by number of failed workers (None: fatal)."""

    def __init__(self, name: str, by_k: dict[int, float | None]) -> None:
        super().__init__(JOB, COSTS)
        self.name, self.by_k = name, by_k

    @property
    def switch_s(self) -> float:
        return self.costs.reroute_s

    def evaluate(self, scenario: FailureScenario) -> Outcome:
        return Outcome(self.by_k[len(scenario.failed)])


def run(strategy: Strategy, fallback_by_k: dict[int, float | None]) -> object:
    fallback = CheckpointRestart(JOB, COSTS, shrink=Fixed("shrink", fallback_by_k))  # type: ignore[arg-type]
    return simulate(JOB, {strategy.name: strategy}, fallback, TRACE, 300.0, COSTS, 100.0, 4000.0)[
        strategy.name
    ]


def test_absorbed_failure_costs_the_inflight_iteration_and_the_switch() -> None:
    # 0-50 @1 (50); stall 4+6 -> 60; @0.5 to 110 (25), checkpoint 110-120; @0.5 to 150 (15);
    # rejoin: stall 8+6 -> 164; @1 to 234 (70), checkpoint 234-244; @1 to 300 (56). Total 216.
    fig = run(Fixed("recycle", {0: 4000.0, 1: 8000.0}), {0: 4000.0, 1: 8000.0})
    assert fig.samples == pytest.approx(216.0)  # type: ignore[attr-defined]
    assert fig.recovery_s == pytest.approx(24.0)  # type: ignore[attr-defined]
    assert fig.checkpoint_s == pytest.approx(20.0)  # type: ignore[attr-defined]
    assert fig.checkpoint_fallbacks == 0 and fig.lost_work_s == 0  # type: ignore[attr-defined]
    assert fig.retained_vs_1f1b == pytest.approx(216.0 / 300.0)  # type: ignore[attr-defined]


def test_fatal_failure_falls_back_to_checkpoint_restart() -> None:
    # 0-50 @1 (50, lost); restart 50-100; fallback @0.5 to 150 (25); rejoin: checkpoint 150-160,
    # restart 160-210 back to own mode; @1 to 300 (90). Total 115, one fallback, two restarts.
    fig = run(Fixed("recycle", {0: 4000.0, 1: None}), {0: 4000.0, 1: 8000.0})
    assert fig.samples == pytest.approx(115.0)  # type: ignore[attr-defined]
    assert fig.checkpoint_fallbacks == 1 and fig.restarts == 2  # type: ignore[attr-defined]
    assert fig.lost_work_s == pytest.approx(50.0)  # type: ignore[attr-defined]
    assert fig.fallback_events == [{"time_s": 50.0, "failed": [[0, 1]]}]  # type: ignore[attr-defined]


def test_checkpoint_restart_with_spares_ignores_the_rejoin() -> None:
    # 0-50 @1 lost; restart 50-100 onto a spare, full speed: 100-200 (100), checkpoint 200-210,
    # 210-300 (90). The rejoin at 150 concerns a replaced worker: no cost. Total 190.
    costs = Costs(checkpoint_s=10, restart_s=50, spares=True)
    full = Fixed("shrink", {0: 4000.0, 1: 8000.0})
    ckpt = CheckpointRestart(JOB, costs, shrink=full)  # type: ignore[arg-type]
    fig = simulate(JOB, {"cr": ckpt}, ckpt, TRACE, 300.0, costs, 100.0, 4000.0)["cr"]
    assert fig.samples == pytest.approx(190.0)
    assert fig.restarts == 1


def test_lost_stage_stalls_until_rejoin_and_never_crashes() -> None:
    # both workers of stage 1 fail: re-routing, shrink and restart-without-spares cannot run
    trace = [Event(10.0, (0, 1), FAIL), Event(20.0, (1, 1), FAIL), Event(100.0, (1, 1), REJOIN)]
    strategies = make_strategies(JOB, Costs(checkpoint_s=1, restart_s=5, reroute_s=1))
    fallback = strategies["checkpoint-restart"]
    assert isinstance(fallback, CheckpointRestart)
    runs = simulate(JOB, strategies, fallback, trace, 200.0, Costs(checkpoint_s=1, restart_s=5), 50.0, 9.0)
    assert runs["recycle"].checkpoint_fallbacks == 1
    assert runs["recycle"].stalled_s > 70.0
    assert runs["oobleck"].checkpoint_fallbacks == 1
    assert runs["bamboo"].checkpoint_fallbacks == 0  # stage 0 holds copies of stage 1
    assert all(r.samples > 0 for r in runs.values())


def test_simulation_is_deterministic_for_a_seed() -> None:
    trace = generate_trace(JOB, mtbf_s=2000, repair_s=300, duration_s=20_000, seed=5)
    costs = Costs(checkpoint_s=5, restart_s=60)

    def once() -> dict[str, float]:
        s = make_strategies(JOB, costs, names=("recycle", "oobleck", "checkpoint-restart"))
        fb = s["checkpoint-restart"]
        assert isinstance(fb, CheckpointRestart)
        return {n: r.samples for n, r in simulate(JOB, s, fb, trace, 20_000, costs, 300.0, 9.0).items()}

    assert once() == once()
