"""Each strategy model against hand-computed figures on tiny jobs (uniform stages, no comm).

For classic 1F1B with uniform stages, F per micro-batch and fused BW, no comm and no OPT time,
the steady iteration time is (M + P - 1) * (F + BW): 9 ms for P=2, M=2, F=1, BW=2.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from planner.contract import FailureScenario, JobSpec
from whatif.strategies import (
    Bamboo,
    CheckpointRestart,
    Costs,
    Oobleck,
    make_strategies,
    restart_efficiency,
    young_daly_interval_s,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STAGE = {
    "forward": 1.0,
    "backward_input": 1.0,
    "backward_weight": 1.0,
    "optimizer": 0.0,
    "activation_mib": 1.0,
    "weight_grad_mib": 1.0,
}
ZERO_COMM = {"activation_ms": 0.0, "cross_pipeline_ms": 0.0, "allreduce_ms": 0.0}


def tiny(d: int = 2, p: int = 2, m: int = 2) -> JobSpec:
    return JobSpec.model_validate(
        dict(
            name=f"tiny-p{p}d{d}",
            num_pipelines=d,
            num_stages=p,
            num_microbatches=m,
            stages=[STAGE] * p,
            comm=ZERO_COMM,
        )
    )


def fs(*failed: tuple[int, int]) -> FailureScenario:
    return FailureScenario(failed=list(failed))


def ms(job: JobSpec, name: str, scenario: FailureScenario, costs: Costs | None = None) -> float | None:
    return make_strategies(job, costs or Costs(), names=(name,))[name].outcome(scenario).iteration_time_ms


def test_young_daly_and_restart_efficiency_by_hand() -> None:
    # sqrt(2 * 50 * 10000) - 50 = 950; efficiency 1 - 50/1000 - (475 + 100)/10000 = 0.8925
    assert young_daly_interval_s(10_000, 50) == pytest.approx(950.0)
    assert restart_efficiency(10_000, 50, 100, 950) == pytest.approx(0.8925)
    assert young_daly_interval_s(100, 60) == 100  # delta >= M/2: checkpoint every MTBF
    with pytest.raises(ValueError):
        young_daly_interval_s(0, 1)


def test_failure_free_1f1b_strategies_match_the_formula() -> None:
    job = tiny()
    for name in ("reroute-only", "shrink", "checkpoint-restart", "oobleck"):
        assert ms(job, name, fs()) == pytest.approx(9.0), name  # (2 + 1) * (1 + 2)


def test_shrink_survivor_takes_the_dropped_pipelines_microbatches() -> None:
    # the one fully alive pipeline runs 4 micro-batches: (4 + 1) * 3 = 15
    assert ms(tiny(), "shrink", fs((0, 1))) == pytest.approx(15.0)


def test_checkpoint_restart_runs_shrink_without_spares_and_full_with_spares() -> None:
    job = tiny()
    assert ms(job, "checkpoint-restart", fs((0, 1))) == pytest.approx(15.0)
    assert ms(job, "checkpoint-restart", fs((0, 1)), Costs(spares=True)) == pytest.approx(9.0)


def test_recycle_meets_the_load_bound_and_beats_the_ablations() -> None:
    job = tiny()
    # stage 1 has one alive worker hosting all 4 micro-batches: 4 * (F + B + W) = 12 is a lower bound
    assert ms(job, "recycle", fs((0, 1))) == pytest.approx(12.0)
    assert ms(job, "reroute-only", fs((0, 1))) == pytest.approx(15.0)  # naive, fused BW
    assert 12.0 <= ms(job, "reroute+decoupled", fs((0, 1))) <= 15.0  # type: ignore[operator]


def test_oobleck_regroups_three_survivors_by_hand() -> None:
    # 3 survivors of 2x2: pipelines of depth 2 and 1 (whole model on one worker, F=2, BW=4).
    # Speed split of 4 micro-batches with estimates (m+1)*3 and m*6: 3 and 1 -> max(12, 6) = 12.
    o = Oobleck(tiny(), Costs())
    assert o.outcome(fs((0, 1))).iteration_time_ms == pytest.approx(12.0)
    assert sorted(o.last_config) == [(1, 1), (2, 3)]


def test_oobleck_is_fatal_when_a_stage_has_no_copy_left() -> None:
    assert Oobleck(tiny(), Costs()).outcome(fs((0, 1), (1, 1))).fatal


def test_bamboo_profile_and_failover_by_hand() -> None:
    job = tiny(d=2, p=4, m=4)
    b = Bamboo(job, Costs())
    # failure-free: every F carries the next stage's forward: (4 + 3) * (2 + 2) = 28
    assert b.outcome(fs()).iteration_time_ms == pytest.approx(28.0)
    blocks = b.pipeline_blocks({2})
    assert blocks is not None
    assert [blk.forward for blk in blocks] == [2.0, 3.0, 2.0]  # s1 runs F1 + F2 and the redundant F3
    assert [blk.backward_input + blk.backward_weight for blk in blocks] == [2.0, 4.0, 2.0]
    # the merged worker is the bottleneck: at least M * (3 + 4) = 28 plus the fill of the others
    assert b.outcome(fs((0, 2))).iteration_time_ms >= 28.0  # type: ignore[operator]


@pytest.mark.parametrize("failed", [((0, 1), (0, 2)), ((0, 3), (0, 0))])
def test_bamboo_is_fatal_on_consecutive_stages_of_one_pipeline(failed: tuple[tuple[int, int], ...]) -> None:
    out = Bamboo(tiny(d=2, p=4, m=4), Costs()).outcome(fs(*failed))
    assert out.fatal and "consecutive" in out.reason


def test_bamboo_survives_the_same_stage_in_different_pipelines() -> None:
    assert not Bamboo(tiny(d=2, p=4, m=4), Costs()).outcome(fs((0, 1), (1, 1))).fatal


def test_unrecoverable_stage_is_fatal_for_rerouting_not_a_crash() -> None:
    job = tiny()
    lost = fs((0, 1), (1, 1))
    for name in ("recycle", "reroute-only", "reroute+decoupled", "shrink", "checkpoint-restart"):
        assert ms(job, name, lost) is None, name


def test_outcomes_are_invariant_under_pipeline_permutation() -> None:
    job = tiny(d=2, p=4, m=4)
    s = make_strategies(job, Costs(), names=("bamboo", "oobleck", "shrink"))
    for strat in s.values():
        a = strat.evaluate(fs((0, 2)))
        b = strat.evaluate(fs((1, 2)))
        assert a.iteration_time_ms == b.iteration_time_ms
    assert math.isfinite(s["oobleck"].outcome(fs((1, 3))).iteration_time_ms or math.inf)


def test_checkpoint_restart_is_flagged_as_restarting() -> None:
    assert CheckpointRestart(tiny(), Costs()).restarts


def test_a_baseline_that_runs_over_the_memory_capacity_is_fatal() -> None:
    """Before: the what-if timed the ablations' orders without their memory, so a failure set whose
    1F1B-style orders put more activations on a peer than its capacity holds ran at full speed."""
    job = JobSpec.model_validate_json((EXAMPLES / "gpt3-6.7b-p8d4-mem1x.json").read_text())
    scenario = fs((0, 1), (1, 2), (2, 3))
    ablations = ("reroute-only", "reroute+decoupled", "reroute+decoupled+staggered")
    strategies = make_strategies(job, Costs(), names=(*ablations, "shrink"))
    for name in ablations:
        out = strategies[name].outcome(scenario)
        assert out.fatal and "runs out of memory" in out.reason, (name, out)
        assert "over the capacity of 7296.000 MiB at stage 1" in out.reason, out.reason
    assert not strategies["shrink"].outcome(scenario).fatal  # 1F1B's in-flight count stays P - s
    assert not strategies["reroute-only"].outcome(fs((1, 2))).fatal  # one failure fits
