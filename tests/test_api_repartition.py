"""The service plans re-partitions for a job registered with `repartition: true` (issue 12).

In-process app (TestClient, real solver pools, SQLite): the opt-in and its 422s, the status field,
schedules and worker views (FastAPI route and the fast poll path) carrying `partition` and `migration`,
plans of a re-partition job and of a re-route-only job of the same spec kept apart, the precompute
and the CP-SAT refinement keeping the layer split, and the flag kept across a restart. The same
schema on PostgreSQL: tests/test_api_pg.py's store tests plus the migration here (skipped without
PostgreSQL binaries).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from api.idempotency import request_hash
from api.models import JobCreate
from api.solve_partition import plan_key
from api.solver import from_canonical, relabel_canonical
from planner.contract import FailureScenario, JobSpec
from planner.normalize import normalize
from tests.jobs import tiny_job
from tests.test_api_jobs import CTL, make_client

pytestmark = pytest.mark.timeout(120)


def layered_doc(name: str = "tiny-rp") -> dict[str, Any]:
    """tiny_job(2, 2, 2) with 4 layers derived from its stage figures (`model.layers`)."""
    doc = tiny_job(2, 2, 2).model_dump(mode="json", exclude_none=True)
    return {**doc, "name": name, "model": {"layers": 4, "hidden": 64}}


def register(client: TestClient, doc: dict[str, Any], **extra: Any) -> Any:
    body = {"job": doc, "heartbeat_enabled": False, "max_failures": 0, **extra}
    return client.post("/v1/jobs", json=body, headers=CTL)


def fail(client: TestClient, job_id: str, workers: list[list[int]], kind: str = "fail") -> Any:
    ev = {"event_id": f"{kind}-{workers}-{time.monotonic()}", "kind": kind, "workers": workers}
    r = client.post(f"/v1/jobs/{job_id}/events", json=ev, headers=CTL)
    assert r.status_code == 200, r.text
    return r.json()


def schedule(client: TestClient, job_id: str, worker: str | None = None, **headers: str) -> dict[str, Any]:
    params = {} if worker is None else {"worker": worker}
    r = client.get(f"/v1/jobs/{job_id}/schedule", params=params, headers={**CTL, **headers})
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with make_client(tmp_path_factory.mktemp("data")) as c:
        yield c


def test_opt_in_is_checked_and_shown(client: TestClient) -> None:
    for bad in ("yes", 1, None, "true"):
        r = register(client, layered_doc(), repartition=bad)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "repartition", r.text
    plain = tiny_job(2, 2, 2).model_dump(mode="json", exclude_none=True)  # no per-layer figures
    r = register(client, plain, repartition=True)
    assert r.status_code == 422 and "layers" in r.text, r.text
    assert register(client, plain).status_code == 201  # re-route only needs none
    on = register(client, layered_doc(), repartition=True).json()["id"]
    off = register(client, layered_doc()).json()["id"]
    assert client.get(f"/v1/jobs/{on}", headers=CTL).json()["repartition"] is True
    assert client.get(f"/v1/jobs/{off}", headers=CTL).json()["repartition"] is False
    # the default spelled out or left out: one request (an Idempotency-Key stored before the field
    # existed still matches its retry)
    base = {"job": layered_doc(), "heartbeat_enabled": False}
    same = request_hash(JobCreate.model_validate(base))
    assert request_hash(JobCreate.model_validate({**base, "repartition": False})) == same
    assert request_hash(JobCreate.model_validate({**base, "repartition": True})) != same


def test_views_carry_the_partition_and_plans_stay_apart(client: TestClient) -> None:
    on = register(client, layered_doc(), repartition=True).json()["id"]
    off = register(client, layered_doc()).json()["id"]
    assert "partition" not in schedule(client, on)["schedule"]  # failure-free: the job's own split
    assert "partition" not in schedule(client, on, "0,0")
    moved = fail(client, on, [[1, 0]])
    plain = fail(client, off, [[1, 0]])  # the same spec and failure set: the same normalized key
    assert moved["version"] == plain["version"] == 2
    full = schedule(client, on)["schedule"]
    assert full["partition"] == [[0, 1], [1, 4]], full.get("partition")
    assert full["migration"]["moves"] == [{"layers": [1, 2], "from_stage": 0, "to_stage": 1}]
    assert full["migration"]["estimated_ms"] > 0
    for w in ("0,0", "0,1", "1,1", "1,0"):  # the fast poll path answers these (a worker token would too)
        view = schedule(client, on, w)
        assert view["partition"] == full["partition"] and view["migration"] == full["migration"], w
    # a repeated parameter: the fast path declines, the FastAPI route answers (the same bytes)
    routed = client.get(f"/v1/jobs/{on}/schedule?worker=0,0&after_version=0&after_version=0", headers=CTL)
    fast = client.get(f"/v1/jobs/{on}/schedule?worker=0,0", headers=CTL)
    assert routed.content == fast.content and routed.json()["partition"] == full["partition"]
    assert "partition" not in schedule(client, off)["schedule"]
    assert "partition" not in schedule(client, off, "0,0")
    job = JobSpec.model_validate(layered_doc())
    norm = normalize(job, FailureScenario(failed=[(1, 0)]))
    store = client.app.state.service.store  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while (rp := store.get_plan(plan_key(norm.key, True))) is None or rp.source != "refined":
        assert time.monotonic() < deadline, "the CP-SAT refinement stored no plan"
        time.sleep(0.1)  # the refinement of the greedy version keeps its partition:
    assert json.loads(rp.schedule_json)["partition"] == [[0, 1], [1, 4]]
    rr = store.get_plan(norm.key)
    assert rr is not None
    assert "partition" in json.loads(rp.schedule_json) and "partition" not in json.loads(rr.schedule_json)
    # a relabelling onto pipeline 0's failure keeps the split (the same in every pipeline)
    other = FailureScenario(failed=[(0, 0)])
    relabelled = relabel_canonical(rp.schedule_json, normalize(job, other), other)
    assert relabelled["partition"] == full["partition"] and relabelled["migration"] == full["migration"]
    model = from_canonical(rp.schedule_json, job, other)  # the models' relabelling (the reference)
    assert model.model_dump(mode="json", exclude_none=True) == relabelled
    again = fail(client, on, [[1, 0]], kind="rejoin")  # back to failure-free: the job's own split
    assert "partition" not in schedule(client, on, "0,0") and again["changed"]
    moved2 = fail(client, on, [[0, 0]])  # the stored plan, relabelled
    assert moved2["source"] in ("precomputed", "cpsat"), moved2
    assert schedule(client, on, "1,1")["partition"] == [[0, 1], [1, 4]]


def test_precompute_and_refinement_keep_the_split_and_a_restart_keeps_the_flag(tmp_path: Path) -> None:
    doc = layered_doc("tiny-rp-pre")
    with make_client(tmp_path) as c:
        job_id = register(c, doc, repartition=True, max_failures=1).json()["id"]
        deadline = time.monotonic() + 60
        while True:
            pre = c.get(f"/v1/jobs/{job_id}", headers=CTL).json()["precompute"]
            if pre["total"] and pre["done"] == pre["total"]:
                break
            assert time.monotonic() < deadline, pre
            time.sleep(0.2)
        answer = fail(c, job_id, [[0, 1]])
        assert answer["source"] == "precomputed", answer
        view = schedule(c, job_id, "1,0")
        assert view["partition"] == [[0, 3], [3, 4]], view.get("partition")
        store = c.app.state.service.store  # type: ignore[attr-defined]
        norm = normalize(JobSpec.model_validate(doc), FailureScenario(failed=[(0, 1)]))
        stored = store.get_plan(plan_key(norm.key, True))
        assert stored is not None and stored.source == "refined"
        assert store.get_plan(norm.key) is None  # nothing stored under the re-route-only key
    with make_client(tmp_path) as c:  # the service restarts on the same SQLite file
        status = c.get(f"/v1/jobs/{job_id}", headers=CTL).json()
        assert status["repartition"] is True and status["version"] == 2
        assert schedule(c, job_id, "1,0")["partition"] == [[0, 3], [3, 4]]
        fail(c, job_id, [[0, 1]], kind="rejoin")
        fail(c, job_id, [[1, 0]])  # planned after the restart: still with re-partition
        assert schedule(c, job_id, "0,1")["partition"] == [[0, 1], [1, 4]]


def test_postgres_schema_keeps_the_flag_and_migrates_an_older_database(pg_database: str) -> None:
    """0002_repartition.sql on a database at schema 1 holding a job: the job plans re-route only."""
    psycopg = pytest.importorskip("psycopg")
    from api.records import JobRecord
    from api.settings import Settings
    from api.store import open_store
    from api.store_migrate import migration_files

    (_, first), *_ = migration_files()
    spec = json.dumps(layered_doc())
    with psycopg.connect(pg_database, autocommit=True) as conn:  # a database an older recycle made
        conn.execute(first.read_text().encode())
        conn.execute(
            "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
            "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        conn.execute("INSERT INTO schema_migrations (version, name) VALUES (1, '0001_initial')")
        conn.execute(
            "INSERT INTO jobs (id, name, spec_json, worker_token_hash, created_at, state, max_failures, "
            "heartbeat_enabled, scenario_json, version, unrecoverable_stages, precompute_total, "
            "precompute_done) VALUES ('old', 'x', %s, 'h0', 0, 'running', 0, false, '{}', 0, '[]', 0, 0)",
            (spec,),
        )
    store = open_store(Settings(database_url=pg_database))  # type: ignore[arg-type]
    try:
        old = store.get_job("old")
        assert old is not None and old.repartition is False
        store.create_job(JobRecord(id="new", name="y", spec_json=spec, worker_token_hash="h1", created_at=1.0,
                                   repartition=True))  # fmt: skip
        new = store.get_job("new")
        assert new is not None and new.repartition is True
        store.apply("new", {"repartition": False})
        again = store.get_job("new")
        assert again is not None and again.repartition is False
    finally:
        store.close()


def test_refinement_plans_the_given_partition() -> None:
    """solve() as the refinement calls it: CP-SAT on the published partition's derived job."""
    from api.solver import solve

    job = JobSpec.model_validate(layered_doc())
    scenario = FailureScenario(failed=[(0, 1)])
    out = solve(job.model_dump_json(), scenario.model_dump_json(), 1.0, True, True, "[[0, 1], [1, 4]]")
    assert out.error is None and out.key == plan_key(normalize(job, scenario).key, True)
    doc = json.loads(out.physical_json)
    assert doc["partition"] == [[0, 1], [1, 4]]  # not the [0, 3) / [3, 4) a fresh choice would take
    assert doc["migration"]["moves"] == [{"layers": [1, 2], "from_stage": 0, "to_stage": 1}]
    assert out.figures["repartition"]["partition"] == [[0, 1], [1, 4]]
    own = solve(job.model_dump_json(), scenario.model_dump_json(), 1.0, False, True, "[[0, 2], [2, 4]]")
    assert own.error is None and "partition" not in json.loads(own.physical_json)


def test_what_if_plans_with_repartition(client: TestClient) -> None:
    body = {"job": layered_doc(), "scenario": {"failed": [[1, 0]]}, "use_cpsat": False, "repartition": True}
    r = client.post("/v1/plan", json=body, headers=CTL)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["schedule"]["partition"] == [[0, 1], [1, 4]]
    assert answer["figures"]["repartition"]["repartitioned"] is True
    plain = client.post("/v1/plan", json={**body, "repartition": False}, headers=CTL).json()
    assert "partition" not in plain["schedule"] and "repartition" not in plain["figures"]
    assert plain["schedule"]["iteration_time_ms"] > answer["schedule"]["iteration_time_ms"]
    no_layers = {**body, "job": tiny_job(2, 2, 2).model_dump(mode="json", exclude_none=True)}
    r = client.post("/v1/plan", json=no_layers, headers=CTL)
    assert r.status_code == 422 and "layers" in r.text, r.text
    r = client.post("/v1/plan", json={**body, "repartition": "on"}, headers=CTL)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "repartition", r.text
