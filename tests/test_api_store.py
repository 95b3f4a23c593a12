"""The stores (transactions, monotonic versions, plan upgrades, reopen), on both back-ends: SQLite and
a real PostgreSQL server (bench/pg_cluster.py, skipped without its binaries); and canonical plan mapping."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.settings import Settings
from api.solver import enumerate_scenarios, from_canonical, relabel_canonical, to_canonical
from api.store import (
    EventRecord,
    JobRecord,
    PlanRecord,
    SQLiteStore,
    Store,
    VersionConflictError,
    VersionRecord,
    open_store,
)
from planner.contract import FailureScenario, JobSpec, SlowWorker
from planner.errors import UnrecoverableScenarioError
from planner.normalize import normalize
from planner.plan import plan
from planner.simulator import validate

pytestmark = pytest.mark.timeout(120)

STAGE = {"forward": 1.0, "backward_input": 1.2, "backward_weight": 0.8, "optimizer": 0.5,
         "activation_mib": 10.0, "weight_grad_mib": 5.0}  # fmt: skip
JOB = JobSpec.model_validate(
    {
        "name": "tiny-d3p3",
        "num_pipelines": 3,
        "num_stages": 3,
        "num_microbatches": 3,
        "stages": [STAGE] * 3,
        "comm": {"activation_ms": 0.05, "cross_pipeline_ms": 0.2, "allreduce_ms": 0.4},
    }
)


@pytest.fixture(params=["sqlite", "postgresql"])
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    """Opens the same store (a fresh one per test) on the back-end of the parameter, each call anew."""
    settings = Settings(data_dir=tmp_path)
    if request.param == "postgresql":
        url = request.getfixturevalue("pg_database")
        settings = Settings(database_url=url)
    return lambda: open_store(settings)


def _job(store: Store, job_id: str = "j1") -> None:
    store.create_job(JobRecord(job_id, "n", "{}", f"hash-{job_id}", time.time()))


def test_a_store_file_from_before_the_done_column_is_upgraded(tmp_path: Path) -> None:
    """A jobs table without `done_workers` (written before the finished state) gets the column on
    open; its jobs load with no done workers, and done workers persist from then on."""
    import sqlite3

    old = sqlite3.connect(tmp_path / "recycle.sqlite3")
    old.execute(
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, spec_json TEXT NOT NULL, "
        "worker_token_hash TEXT NOT NULL, created_at REAL NOT NULL, state TEXT NOT NULL, "
        "max_failures INTEGER NOT NULL, heartbeat_enabled INTEGER NOT NULL, heartbeat_timeout_s REAL, "
        "scenario_json TEXT NOT NULL, version INTEGER NOT NULL, unrecoverable_stages TEXT NOT NULL, "
        "precompute_total INTEGER NOT NULL, precompute_done INTEGER NOT NULL)"
    )
    row = "('j0', 'n', '{}', 'h0', 1.0, 'running', 2, 1, NULL, '{}', 1, '[]', 0, 0)"
    old.execute(f"INSERT INTO jobs VALUES {row}")
    old.commit()
    old.close()
    store = SQLiteStore(tmp_path)
    (job,) = store.list_jobs()
    assert job.id == "j0" and job.done_workers == []
    store.apply("j0", {"done_workers": [[0, 1]], "state": "finished"})
    store.close()
    again = SQLiteStore(tmp_path)  # a second open does not add the column twice
    job2 = again.get_job("j0")
    assert job2 is not None and job2.done_workers == [[0, 1]] and job2.state == "finished"
    again.close()


def _ver(job_id: str, v: int) -> VersionRecord:
    return VersionRecord(job_id, v, "{}", f'{{"v": {v}}}', "greedy", 1.0, None, time.time())


def test_versions_are_consecutive_and_atomic(reopen: Callable[[], Store]) -> None:
    store = reopen()
    _job(store)
    store.apply("j1", {}, version=_ver("j1", 1))
    with pytest.raises(VersionConflictError):
        store.apply("j1", {}, version=_ver("j1", 3))
    ev = EventRecord("j1", "e1", 1, "{}", 200, "{}", time.time())
    with pytest.raises(VersionConflictError):  # nothing of a failed apply is kept, not even the event
        store.apply("j1", {"state": "needs_restore"}, version=_ver("j1", 1), event=ev)
    assert store.get_event("j1", "e1") is None
    job = store.get_job("j1")
    assert job is not None and job.state == "running" and job.version == 1
    store.apply("j1", {"unrecoverable_stages": [2]}, version=_ver("j1", 2), event=ev)
    store.close()
    again = reopen()  # reopen: everything is there
    job = again.get_job("j1")
    assert job is not None and job.version == 2 and job.unrecoverable_stages == [2]
    latest = again.latest_version("j1")
    assert latest is not None and latest.schedule_json == '{"v": 2}'
    assert [v[0] for v in again.list_versions("j1")] == [1, 2]
    assert again.get_event("j1", "e1") is not None
    assert again.job_id_for_token_hash("hash-j1") == "j1" and again.job_id_for_token_hash("x") is None
    again.close()


def test_plans_keep_the_best_and_upgrade_greedy(reopen: Callable[[], Store]) -> None:
    store = reopen()
    assert store.put_plan(PlanRecord("k", "a", "greedy", 10.0))
    assert not store.put_plan(PlanRecord("k", "b", "greedy", 11.0))
    assert store.put_plan(PlanRecord("k", "c", "refined", 10.0))  # same time, now refined
    assert not store.put_plan(PlanRecord("k", "d", "refined", 10.0))
    assert not store.put_plan(PlanRecord("k", "e", "greedy", 10.0))
    assert store.put_plan(PlanRecord("k", "f", "greedy", 9.0))
    got = store.get_plan("k")
    assert got is not None and got.schedule_json == "f"
    assert store.plan_keys(["k", "z"]) == {"k"}
    store.close()


def test_enumerate_scenarios_one_per_key() -> None:
    scenarios = enumerate_scenarios(JOB, 2, limit=1000)
    keys = [normalize(JOB, sc).key for sc in scenarios]
    assert len(keys) == len(set(keys))
    assert scenarios[0].failed == []
    # every recoverable physical pair maps onto an enumerated key
    for a in range(9):
        for b in range(a + 1, 9):
            sc = FailureScenario(failed=[(a // 3, a % 3), (b // 3, b % 3)])
            try:
                sc.check_against(JOB)
            except UnrecoverableScenarioError:
                continue
            assert normalize(JOB, sc).key in keys
    assert len(enumerate_scenarios(JOB, 2, limit=3)) == 3


workers = st.tuples(st.integers(0, 2), st.integers(0, 2))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(workers, min_size=1, max_size=3, unique=True), st.data())
def test_canonical_plan_maps_onto_every_physical_scenario_with_its_key(
    failed: list[tuple[int, int]], data: st.DataObject
) -> None:
    scenario = FailureScenario(failed=failed)
    try:
        scenario.check_against(JOB)
    except UnrecoverableScenarioError:
        return
    result = plan(JOB, scenario, use_cpsat=False)
    canonical = to_canonical(result.schedule, normalize(JOB, scenario))
    perm = data.draw(st.permutations(range(3)))
    other = FailureScenario(failed=[(perm[d], s) for d, s in failed])
    assert normalize(JOB, other).key == result.key
    mapped = from_canonical(canonical.model_dump_json(), JOB, other)
    report = validate(JOB, other, mapped)  # the referee accepts the relabelled plan
    assert report.iteration_time_ms == pytest.approx(result.iteration_time_ms, rel=1e-9)
    assert sorted(tuple(w) for w in mapped.failed) == sorted(tuple(w) for w in other.failed)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(workers, min_size=0, max_size=2, unique=True),
    st.lists(st.tuples(workers, st.sampled_from([1.5, 2.0])), max_size=2, unique_by=lambda x: x[0]),
    st.data(),
)
def test_event_path_relabel_equals_the_model_relabel(
    failed: list[tuple[int, int]], slow: list[tuple[tuple[int, int], float]], data: st.DataObject
) -> None:
    """relabel_canonical (plain JSON, the event path) gives the document from_canonical gives."""
    slow_workers = [SlowWorker(worker=w, factor=f) for w, f in slow if w not in failed]
    scenario = FailureScenario(failed=sorted(failed), slow=slow_workers)
    try:
        scenario.check_against(JOB)
    except UnrecoverableScenarioError:
        return
    result = plan(JOB, scenario, use_cpsat=False)
    canonical = to_canonical(result.schedule, normalize(JOB, scenario)).model_dump_json(exclude_none=True)
    perm = data.draw(st.permutations(range(3)))
    other = FailureScenario(
        failed=sorted((perm[d], s) for d, s in scenario.failed),
        slow=[SlowWorker(worker=(perm[w.worker[0]], w.worker[1]), factor=w.factor) for w in scenario.slow],
    )
    reference = json.loads(from_canonical(canonical, JOB, other).model_dump_json(exclude_none=True))
    assert relabel_canonical(canonical, normalize(JOB, other), other) == reference
