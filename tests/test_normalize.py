"""Failure normalization: permuted scenarios share a key and plans map back correctly."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from planner.contract import FailureScenario, JobSpec, SlowWorker
from planner.normalize import normalize
from planner.plan import plan
from planner.simulator import validate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _job(name: str) -> JobSpec:
    return JobSpec.model_validate(json.loads((EXAMPLES / f"{name}.json").read_text()))


def test_permutations_share_one_key() -> None:
    job = _job("gpt3-1.3b-p4d4")
    keys = set()
    for perm in itertools.permutations(range(4)):
        sc = FailureScenario(failed=[(perm[1], 2), (perm[3], 0)])
        keys.add(normalize(job, sc).key)
    assert len(keys) == 1


def test_different_scenarios_get_different_keys() -> None:
    job = _job("gpt3-1.3b-p4d4")
    a = normalize(job, FailureScenario(failed=[(1, 2), (3, 0)])).key
    b = normalize(job, FailureScenario(failed=[(1, 2), (1, 0)])).key  # same pipeline: a different case
    c = normalize(job, FailureScenario(failed=[(1, 2)], slow=[SlowWorker(worker=(0, 1), factor=1.5)])).key
    assert len({a, b, c}) == 3


@pytest.mark.parametrize("failed", [[(3, 1)], [(0, 2), (2, 2)], [(2, 0), (1, 3)]])
def test_mapped_back_plan_is_valid_for_physical_workers(failed: list[tuple[int, int]]) -> None:
    job = _job("gpt3-1.3b-p4d4")
    scenario = FailureScenario(failed=failed)
    result = plan(job, scenario, use_cpsat=False)
    assert sorted(map(tuple, result.schedule.failed)) == sorted(failed)
    names = {tuple(w.worker) for w in result.schedule.workers}
    assert not names & set(failed)
    report = validate(job, scenario, result.schedule)
    # The same scenario relabelled has the same iteration time.
    swapped = FailureScenario(failed=[((d + 1) % 4, s) for d, s in failed])
    other = plan(job, swapped, use_cpsat=False)
    assert other.key == result.key
    assert abs(other.iteration_time_ms - report.iteration_time_ms) < 1e-6


@pytest.mark.parametrize(
    "scenario",
    [
        FailureScenario(failed=[(9, 0)]),
        FailureScenario(failed=[(0, 4)]),
        FailureScenario(failed=[(1, 1)], slow=[SlowWorker(worker=(4, 0), factor=2.0)]),
    ],
)
def test_out_of_grid_worker_is_refused_by_every_entry_point(scenario: FailureScenario) -> None:
    """A worker outside the grid used to drop out of the signatures: the scenario became
    failure-free and what-if planned it as such. normalize() and everything built on it refuse it."""
    from planner.errors import InvalidInputError
    from whatif.estimate import estimate_record
    from whatif.strategies.recycle import plan_record
    from whatif.strategies.repartition import repartition_record

    job = _job("gpt3-1.3b-p4d4")
    calls = [
        lambda: normalize(job, scenario),
        lambda: plan_record(job, scenario, keep_schedule=False),
        lambda: estimate_record(job, scenario),
        lambda: repartition_record(job, scenario, exact=False, time_limit=None),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidInputError, match=r"is outside the job's grid \(4 pipelines x 4 stages\)"):
            call()
