"""Re-partition with a stage that holds no layer (issue 12 follow-up): a stage left one survivor
out of D hands all its layers to its neighbours; its workers run only its extras (zero-duration
F/B/W/OPT for derived figures) and pass activations and gradients through."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from planner.contract import FailureScenario, JobSpec, Schedule, check_partition
from planner.errors import InvalidInputError, ScheduleRuleError
from planner.normalize import normalize
from planner.partition import derive_job, layer_model, migration
from planner.partition.choose import plan_repartition
from planner.partition.search import best_partition, partition_bound, stage_costs
from planner.simulator import validate
from tests.test_partition_cli import job_doc as cli_job_doc
from whatif.cache import PlanCache
from whatif.strategies import Costs, make_strategies
from whatif.strategies.repartition import KIND, RECORD_VERSION

ROOT = Path(__file__).resolve().parents[1]
LONE = FailureScenario(failed=[(0, 1), (1, 1), (2, 1)])  # stage 1 keeps one survivor out of 4


def job_doc(**extra: Any) -> dict[str, Any]:
    """test_partition_cli's tiny job with D=4 and 3x longer ops: 6 layers of derived figures (2 per
    stage), memory to spare."""
    stage = {**cli_job_doc()["stages"][0], "forward": 3.0, "backward_input": 3.0, "backward_weight": 3.0}
    mine = {"name": "lone", "num_pipelines": 4, "num_microbatches": 4, "stages": [stage] * 3,
            "model": {"layers": 6, "hidden": 128}, "memory_capacity_mib": 1000.0}  # fmt: skip
    return cli_job_doc(**{**mine, **extra})


def _splits(num_layers: int, num_stages: int, empty: bool) -> list[list[list[int]]]:
    pick = itertools.combinations_with_replacement if empty else itertools.combinations
    cuts = pick(range(num_layers + 1) if empty else range(1, num_layers), num_stages - 1)
    return [[[b[i], b[i + 1]] for i in range(num_stages)] for b in ([0, *c, num_layers] for c in cuts)]


def test_partition_rules_a_schedule_may_leave_a_stage_empty() -> None:
    assert check_partition([[0, 2], [2, 2], [2, 4]], 4, 3, allow_empty=True) == [[0, 2], [2, 2], [2, 4]]
    assert check_partition([[0, 0], [0, 4], [4, 4]], 4, 3, allow_empty=True)[2] == [4, 4]
    with pytest.raises(InvalidInputError, match=r"partition: stage 1 holds no layer \(\[2, 2\)\)"):
        check_partition([[0, 2], [2, 2], [2, 4]], 4, 3)
    with pytest.raises(InvalidInputError, match=r"partition: stage 1: range \[3, 2\) ends before it starts"):
        check_partition([[0, 3], [3, 2], [2, 4]], 4, 3, allow_empty=True)
    with pytest.raises(InvalidInputError, match=r"partition: stage 2: empty range \[5, 5\) is outside 0..4"):
        check_partition([[0, 2], [2, 4], [5, 5]], 4, 3, allow_empty=True)
    # The job spec's own input rule holds with derived per-layer figures (0 layers cannot share a
    # stage's figures) and relaxes beside given ones (a derived job of planner.partition).
    with pytest.raises(ValueError, match="partition: stage 1 holds no layer"):
        JobSpec.model_validate(job_doc(partition=[[0, 3], [3, 3], [3, 6]]))
    derived = derive_job(JobSpec.model_validate(job_doc()), [[0, 3], [3, 3], [3, 6]])
    assert derived.partition_ranges() == [[0, 3], [3, 3], [3, 6]] and derived.layer_profiles() is not None
    assert JobSpec.model_validate_json(derived.model_dump_json()) == derived
    with pytest.raises(InvalidInputError, match="stage 1 holds no layer in the job's partition"):
        derive_job(derived, [[0, 2], [2, 4], [4, 6]])  # no per-layer scale for its optimizer


def test_the_lone_survivors_stage_is_emptied_when_that_lowers_the_bound() -> None:
    job = JobSpec.model_validate(job_doc())
    model = layer_model(job)
    costs = stage_costs(job, model, LONE)
    best, found = best_partition(costs)
    non_empty = min(partition_bound(costs, p) for p in _splits(6, 3, empty=False))
    assert found is not None and found[1][0] == found[1][1] and best < non_empty * 0.9
    derived = derive_job(job, found, model)
    empty_stage = derived.stages[1]
    assert (empty_stage.forward, empty_stage.backward_weight, empty_stage.optimizer) == (0.0, 0.0, 0.0)
    assert derived.allreduce_ms(1) == 0.0
    assert derived.capacity_mib(0) < 1000.0 < derived.capacity_mib(1)  # type: ignore[operator]
    mig = migration(job, found, model, scenario=LONE)
    assert sum(m.layers[1] - m.layers[0] for m in mig.moves if m.from_stage == 1) == 2  # all of them


@pytest.mark.timeout(90)
@pytest.mark.parametrize("use_cpsat", [False, True])
def test_the_chosen_schedule_with_an_empty_stage_replays_and_round_trips(use_cpsat: bool) -> None:
    """Slow hops keep greedy above its bound, so CP-SAT runs on zero-size intervals too."""
    job = JobSpec.model_validate(
        job_doc(comm={"activation_ms": 1.0, "cross_pipeline_ms": 2.0, "allreduce_ms": 0.3})
    )
    rep = plan_repartition(job, LONE, time_limit=timedelta(seconds=2), use_cpsat=use_cpsat)
    a, b = rep.partition[1]
    assert a == b and rep.repartitioned, rep.partition
    assert rep.result.cpsat.get("status") in (("FEASIBLE", "OPTIMAL") if use_cpsat else (None,))
    assert rep.load_bound_ms == pytest.approx(rep.best_load_bound_ms)
    assert rep.iteration_time_ms < rep.reroute_load_bound_ms
    sched = Schedule.model_validate_json(rep.result.schedule.model_dump_json())
    assert sched.partition_ranges() == rep.partition
    report = validate(job, LONE, sched)  # the simulator derives the job from the partition
    assert report.iteration_time_ms == pytest.approx(rep.iteration_time_ms)
    lone = next(w for w in sched.workers if w.worker[1] == 1)
    f_count = sum(x.op == "F" for x in lone.actions)
    assert f_count == job.num_pipelines * job.num_microbatches  # every micro-batch passes through


def test_the_validator_still_checks_a_schedule_with_an_empty_stage() -> None:
    job = JobSpec.model_validate(job_doc())
    rep = plan_repartition(job, LONE, use_cpsat=False)
    assert rep.partition[1][0] == rep.partition[1][1]
    doc = rep.result.schedule.model_dump(mode="json")
    lone = next(w for w in doc["workers"] if w["worker"][1] == 1)
    lone["actions"] = [x for i, x in enumerate(lone["actions"]) if i != 0]  # drop its first F
    with pytest.raises(ScheduleRuleError):
        validate(job, LONE, Schedule.model_validate(doc))
    claim = rep.result.schedule.model_dump(mode="json") | {"iteration_time_ms": rep.iteration_time_ms * 0.9}
    with pytest.raises(ScheduleRuleError, match="claim"):
        validate(job, LONE, Schedule.model_validate(claim))
    moved = rep.result.schedule.model_dump(mode="json") | {"partition": [[0, 2], [2, 4], [4, 6]]}
    with pytest.raises(ScheduleRuleError, match="claim"):  # same orders, the job's own split
        validate(job, LONE, Schedule.model_validate(moved))


@pytest.mark.timeout(60)
def test_whatif_strategy_empties_the_stage_and_charges_the_migration(tmp_path: Path) -> None:
    job = JobSpec.model_validate(job_doc())
    names = ("recycle", "recycle+repartition")
    cache = PlanCache(tmp_path)
    key = normalize(job, LONE).key
    cache.put(key, {"iteration_time_ms": 1.0, "partition": [[0, 2], [2, 4], [4, 6]]}, kind=KIND + "-estimate")
    models = make_strategies(job, Costs(reroute_s=1.0), cache, names, exact=False)
    rec, rep = models["recycle"], models["recycle+repartition"]
    out = rep.outcome(LONE)  # the stale record (no RECORD_VERSION: every stage >= 1 layer) is re-done
    ms_rec = rec.outcome(LONE).iteration_time_ms
    assert out.iteration_time_ms is not None and ms_rec is not None and 1.0 < out.iteration_time_ms < ms_rec
    assert (cache.get(key, kind=KIND + "-estimate") or {}).get("version") == RECORD_VERSION
    assert "[3, 3]" in out.reason, out.reason
    assert rep.switch_s > 1.0  # re-route plus the migration of stage 1's layers


@pytest.mark.timeout(120)
def test_cli_plan_and_validate_a_schedule_with_an_empty_stage(tmp_path: Path) -> None:
    job, sched = tmp_path / "job.json", tmp_path / "s.json"
    job.write_text(json.dumps(job_doc()))
    fail = [x for d in range(3) for x in ("--fail", f"{d},1")]
    cmd = [sys.executable, "-m", "recycle_cli"]
    out = subprocess.run(
        [*cmd, "plan", str(job), *fail, "--repartition", "--no-cpsat", "--json", "-o", str(sched)],
        cwd=ROOT, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    part = json.loads(sched.read_text())["partition"]
    assert part[1][0] == part[1][1] and json.loads(out.stdout)["repartition"]["partition"] == part
    ok = subprocess.run([*cmd, "validate", str(job), str(sched)], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("VALID"), ok.stdout + ok.stderr
