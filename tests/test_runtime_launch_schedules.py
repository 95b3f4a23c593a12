"""`recycle precompute -o DIR` makes what `recycle launch --schedules DIR` reads: the index proves the
plans are for the launch's job, and each physical failure set gets its normalized plan mapped back."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from planner.contract import FailureScenario
from planner.errors import InvalidInputError
from planner.simulator.structure import check_structure
from runtime_adapter.publishers import PublisherError
from runtime_adapter.schedules import NamedSchedules, PlanDirectory, open_schedules, schedule_file_name
from tests.jobs import uniform_job
from whatif.cache import PlanCache, index_name
from whatif.precompute import precompute

pytestmark = pytest.mark.timeout(120)

JOB = uniform_job(3, 2, 3, name="sched-d3p2")


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plans")
    precompute(JOB, 1, PlanCache(out), num_workers=1, progress=False)
    return out


def test_precomputed_plans_cover_every_physical_failure_set(plans: Path) -> None:
    source = open_schedules(str(plans), JOB)
    assert isinstance(source, PlanDirectory) and "up to 1 failures" in source.describe()
    workers = [(d, s) for d in range(3) for s in range(2)]
    for failed in [frozenset(), *(frozenset(c) for c in itertools.combinations(workers, 1))]:
        schedule = source(failed)
        scenario = FailureScenario(failed=sorted(failed))
        check_structure(JOB, scenario, schedule)  # un-normalized onto the physical pipelines
        assert {tuple(w) for w in schedule.failed} == set(failed)
    with pytest.raises(PublisherError, match=r"covers up to 1 failures.*--max-failures 2"):
        source(frozenset({(0, 0), (2, 1)}))


def test_index_is_kept_when_a_rerun_covers_less(plans: Path) -> None:
    before = json.loads((plans / index_name(JOB)).read_text())
    stats = precompute(JOB, 0, PlanCache(plans), num_workers=1, progress=False)
    assert stats.planned == 0 and json.loads((plans / index_name(JOB)).read_text()) == before
    assert before["max_failures"] == 1 and before["job"]["name"] == JOB.name


def test_plans_of_another_job_are_refused(plans: Path) -> None:
    other = uniform_job(3, 2, 3, op_ms=2.0, name="sched-d3p2")  # same name and shape, other profile
    with pytest.raises(InvalidInputError, match="holds plans of another job spec"):
        open_schedules(str(plans), other)


def test_no_index_no_plans_and_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="not a directory"):
        open_schedules(str(tmp_path / "nope"), JOB)
    with pytest.raises(InvalidInputError, match=r"no plan index for this job: write one"):
        open_schedules(str(tmp_path), JOB)
    (tmp_path / "0123456789abcdef01234567.json").write_text("{}")
    with pytest.raises(InvalidInputError, match="interrupted precompute"):
        open_schedules(str(tmp_path), JOB)


def test_named_schedules_are_checked_against_the_job(plans: Path, tmp_path: Path) -> None:
    source = open_schedules(str(plans), JOB)
    for failed in [frozenset(), frozenset({(1, 1)})]:
        (tmp_path / schedule_file_name(failed)).write_text(source(failed).model_dump_json())
    named = open_schedules(str(tmp_path), JOB)
    assert isinstance(named, NamedSchedules) and "2 named schedules" in named.describe()
    assert [tuple(w) for w in named(frozenset({(1, 1)})).failed] == [(1, 1)]
    with pytest.raises(PublisherError, match="no usable schedule"):
        named(frozenset({(0, 0)}))
    # a schedule under the wrong name is caught before anything starts
    (tmp_path / "failed-0.1.json").write_text(source(frozenset({(1, 1)})).model_dump_json())
    with pytest.raises(InvalidInputError, match=r"failed-0.1.json does not fit job"):
        open_schedules(str(tmp_path), JOB)
    (tmp_path / "failed-0.1.json").unlink()
    with pytest.raises(InvalidInputError, match="schedule is for job 'sched-d3p2'"):
        open_schedules(str(tmp_path), uniform_job(3, 2, 3, name="another"))


def test_plan_on_demand_fills_a_new_or_partial_directory(plans: Path, tmp_path: Path) -> None:
    fresh = open_schedules(str(tmp_path / "new"), JOB, plan_on_demand=True)
    assert isinstance(fresh, PlanDirectory) and "planned when they happen" in fresh.describe()
    assert len(list((tmp_path / "new").glob("*.json"))) == 1  # the failure-free plan, made at once
    shutil.copytree(plans, tmp_path / "plans")  # the module's directory stays as precompute left it
    partial = open_schedules(str(tmp_path / "plans"), JOB, plan_on_demand=True)
    assert "up to 1 failures, the others planned when they happen" in partial.describe()
    failed = frozenset({(0, 0), (2, 1)})
    schedule = partial(failed)
    check_structure(JOB, FailureScenario(failed=sorted(failed)), schedule)
    assert open_schedules(str(tmp_path / "plans"), JOB)(failed) == schedule  # added to the directory
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidInputError, match="not a directory"):
        open_schedules(str(tmp_path / "file"), JOB, plan_on_demand=True)
