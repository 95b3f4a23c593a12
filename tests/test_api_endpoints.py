"""Every HTTP endpoint through TestClient, including the 401/403/404/409/413/422 paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from api.main import create_app
from api.settings import Settings
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.simulator import validate
from tests.jobs import service_job_doc

pytestmark = pytest.mark.timeout(120)

TINY: dict[str, Any] = service_job_doc(3, 2, 2)
CTL = {"Authorization": "Bearer controller-secret"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("data"),
        controller_token="controller-secret",  # type: ignore[arg-type]
        precompute_time_limit_s=1.0,
        refine_time_limit_s=1.0,
        max_body_bytes=20_000,
        heartbeat_timeout_s=0.6,
        heartbeat_check_s=0.1,
        max_wait_s=2.0,
    )
    with TestClient(create_app(settings)) as c:
        yield c


def new_job(client: TestClient, **extra: Any) -> tuple[str, dict[str, str]]:
    r = client.post("/v1/jobs", json={"job": TINY, "heartbeat_enabled": False, **extra}, headers=CTL)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["version"] == 1 and body["state"] == "running"
    return body["id"], {"Authorization": f"Bearer {body['worker_token']}"}


def event(client: TestClient, job_id: str, event_id: str, kind: str, workers: list[list[int]], **kw: Any):  # type: ignore[no-untyped-def]
    body = {"event_id": event_id, "kind": kind, "workers": workers, **kw}
    return client.post(f"/v1/jobs/{job_id}/events", json=body, headers=CTL)


def test_create_and_get_job(client: TestClient) -> None:
    job_id, worker = new_job(client)
    for headers in (CTL, worker):
        r = client.get(f"/v1/jobs/{job_id}", headers=headers)
        assert r.status_code == 200
        doc = r.json()
        assert doc["name"] == "tiny-d3p2" and doc["failed"] == [] and doc["version"] == 1
        assert doc["precompute"]["total"] >= doc["precompute"]["done"] >= 0


def test_auth_401_and_403(client: TestClient) -> None:
    job_id, worker = new_job(client)
    other_id, other_worker = new_job(client)
    assert client.post("/v1/jobs", json={"job": TINY}).status_code == 401
    r = client.post("/v1/jobs", json={"job": TINY}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert client.get(f"/v1/jobs/{job_id}/schedule").status_code == 401
    # a worker token: reads its own job and posts its events (an agent has only that token), nothing else
    assert client.get(f"/v1/jobs/{job_id}/schedule", headers=worker).status_code == 200
    assert client.get(f"/v1/jobs/{other_id}/schedule", headers=worker).status_code == 403
    assert client.get(f"/v1/jobs/{job_id}/schedule", headers=other_worker).status_code == 403
    body = {"event_id": "x", "kind": "fail", "workers": [[0, 0]]}
    assert client.post(f"/v1/jobs/{other_id}/events", json=body, headers=worker).status_code == 403
    assert client.post("/v1/jobs", json={"job": TINY}, headers=worker).status_code == 403
    assert client.patch(f"/v1/jobs/{job_id}", json={}, headers=worker).status_code == 403


def test_404_and_422(client: TestClient) -> None:
    assert client.get("/v1/jobs/nope", headers=CTL).status_code == 404
    assert client.get("/v1/jobs/nope/schedule", headers=CTL).status_code == 404
    assert event(client, "nope", "e", "fail", [[0, 0]]).status_code == 404
    bad = dict(TINY, num_stages=3)  # stages has 2 entries
    assert client.post("/v1/jobs", json={"job": bad}, headers=CTL).status_code == 422
    huge = dict(TINY, num_pipelines=1000, num_stages=1000, stages=[TINY["stages"][0]] * 1000)
    r = client.post("/v1/jobs", json={"job": huge}, headers=CTL)
    assert r.status_code in (413, 422)
    r = client.post("/v1/jobs", json={"job": TINY, "max_failures": 4}, headers=CTL)
    assert r.status_code == 422 and "max_failures" in r.json()["detail"]
    job_id, _ = new_job(client)
    assert event(client, job_id, "e", "fail", [[5, 0]]).status_code == 422  # off the grid
    assert event(client, job_id, "e", "slow", [[0, 0]]).status_code == 422  # slow needs factor
    assert event(client, job_id, "e", "boom", [[0, 0]]).status_code == 422
    assert client.get(f"/v1/jobs/{job_id}/schedule?worker=9,9", headers=CTL).status_code == 422
    assert client.get(f"/v1/jobs/{job_id}/schedule?worker=zz", headers=CTL).status_code == 422
    # a heartbeat timeout of 1e-9 s made every poll a busy loop and failed a worker at once
    r = client.post("/v1/jobs", json={"job": TINY, "heartbeat_timeout_s": 1e-9}, headers=CTL)
    assert r.status_code == 422 and "heartbeat_timeout_s" in r.text
    r = client.patch(f"/v1/jobs/{job_id}", json={"heartbeat_timeout_s": 0.05}, headers=CTL)
    assert r.status_code == 422 and "heartbeat_timeout_s" in r.text


def test_unknown_paths_and_methods_answer_in_the_error_shape(client: TestClient) -> None:
    """Routing and auth errors carry `error` like the domain errors; a 405's Allow names every method
    of the path (Starlette named only the first route's: `POST` on /v1/jobs, which GET lists too)."""
    job_id, worker = new_job(client)
    for method, path, allow in [
        ("DELETE", "/v1/jobs", "GET, HEAD, POST"),
        ("PUT", "/v1/jobs", "GET, HEAD, POST"),
        ("OPTIONS", "/v1/jobs", "GET, HEAD, POST"),
        ("DELETE", f"/v1/jobs/{job_id}", "GET, HEAD, PATCH"),
        ("PUT", f"/v1/jobs/{job_id}/events", "POST"),
        ("POST", f"/v1/jobs/{job_id}/schedule", "GET, HEAD"),
    ]:
        r = client.request(method, path, headers=CTL)
        assert r.status_code == 405 and r.headers["allow"] == allow, (method, path, r.headers)
        assert r.json() == {
            "detail": f"{method} is not allowed on {path} (allowed: {allow})",
            "error": "method_not_allowed",
        }
    r = client.get("/v2/jobs", headers=CTL)
    assert r.status_code == 404
    assert r.json() == {"detail": "no route serves /v2/jobs", "error": "unknown_path"}
    r = client.get("/v1/jobs/nope", headers=CTL)
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    r = client.get("/v1/jobs")
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"
    r = client.get("/v1/jobs", headers=worker)
    assert r.status_code == 403 and r.json()["error"] == "forbidden"


def test_dimension_bound_d_times_p_times_m(client: TestClient) -> None:
    big = dict(TINY, num_microbatches=4096, num_pipelines=100)  # 100*2*4096 > 300k
    r = client.post("/v1/jobs", json={"job": big}, headers=CTL)
    assert r.status_code == 422 and "D*P*M" in r.json()["detail"]


def test_body_size_limit(client: TestClient) -> None:
    r = client.post("/v1/jobs", content=b"{" + b" " * 30_000 + b"}", headers=CTL)
    assert r.status_code == 413


def test_events_fail_rejoin_slow_and_versions(client: TestClient) -> None:
    job_id, _ = new_job(client)
    r = event(client, job_id, "f1", "fail", [[1, 1]])
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 2 and r.json()["failed"] == [[1, 1]] and r.json()["changed"]
    r = event(client, job_id, "s1", "slow", [[0, 0]], factor=1.5)
    assert r.status_code == 200 and r.json()["version"] == 3
    r = event(client, job_id, "f1-again", "fail", [[1, 1]])  # no change: no new version
    assert r.json()["version"] == 3 and not r.json()["changed"]
    r = event(client, job_id, "r1", "rejoin", [[1, 1]])
    assert r.json()["version"] == 4 and r.json()["failed"] == []
    doc = client.get(f"/v1/jobs/{job_id}", headers=CTL).json()
    assert doc["version"] == 4 and doc["slow"] == [{"worker": [0, 0], "factor": 1.5}]
    sched = Schedule.model_validate(client.get(f"/v1/jobs/{job_id}/schedule", headers=CTL).json()["schedule"])
    scenario = FailureScenario.model_validate({"failed": [], "slow": doc["slow"]})
    validate(JobSpec.model_validate(TINY), scenario, sched)  # the referee accepts what is served


def test_event_replay_is_idempotent_and_conflict_is_409(client: TestClient) -> None:
    job_id, _ = new_job(client)
    first = event(client, job_id, "e1", "fail", [[2, 0]])
    again = event(client, job_id, "e1", "fail", [[2, 0]])
    assert first.status_code == again.status_code == 200
    assert again.json()["replayed"] and again.json()["version"] == first.json()["version"] == 2
    assert client.get(f"/v1/jobs/{job_id}", headers=CTL).json()["version"] == 2
    r = event(client, job_id, "e1", "fail", [[0, 0]])
    assert r.status_code == 409 and r.json()["error"] == "event_conflict"


def test_unrecoverable_is_409_naming_the_stage_with_restore_policy_manual(client: TestClient) -> None:
    job_id, _ = new_job(client, restore_policy="manual")  # the auto default: tests/test_api_restore.py
    r = event(client, job_id, "all-stage-1", "fail", [[0, 1], [1, 1], [2, 1]])
    assert r.status_code == 409
    assert r.json()["stages"] == [1] and "stage 1" in r.json()["detail"]
    assert "checkpoint" in r.json()["action"]
    doc = client.get(f"/v1/jobs/{job_id}", headers=CTL).json()
    assert doc["state"] == "needs_restore" and doc["unrecoverable_stages"] == [1]
    replay = event(client, job_id, "all-stage-1", "fail", [[0, 1], [1, 1], [2, 1]])
    assert replay.status_code == 409 and replay.json()["stages"] == [1]
    r = event(client, job_id, "back", "rejoin", [[0, 1]])
    assert r.status_code == 200 and r.json()["state"] == "running"


def test_schedule_etag_304_and_long_poll_timeout(client: TestClient) -> None:
    job_id, worker = new_job(client)
    r = client.get(f"/v1/jobs/{job_id}/schedule", headers=worker)
    assert r.status_code == 200 and r.headers["etag"] == '"1"' and r.json()["version"] == 1
    r = client.get(f"/v1/jobs/{job_id}/schedule", headers={**worker, "If-None-Match": '"1"'})
    assert r.status_code == 304
    r = client.get(f"/v1/jobs/{job_id}/schedule?after_version=1&wait=0.3", headers=worker)
    assert r.status_code == 304 and r.headers["etag"] == '"1"'
    event(client, job_id, "f", "fail", [[0, 1]])
    r = client.get(f"/v1/jobs/{job_id}/schedule?after_version=1&wait=5", headers=worker)
    assert r.status_code == 200 and r.json()["version"] == 2


def test_head_answers_as_get_without_a_body(client: TestClient) -> None:
    """HEAD on a GET path: GET's status and headers (ETag, Content-Length), no body; its errors too
    (401, 404); a path without GET: 405."""
    job_id, worker = new_job(client)
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/schedule", "/v1/jobs", "/healthz", "/readyz"):
        got, head = client.get(path, headers=CTL), client.head(path, headers=CTL)
        assert head.status_code == got.status_code == 200 and head.content == b"", path
        for name in ("content-type", "content-length", "etag"):
            assert head.headers.get(name) == got.headers.get(name), (path, name)
    r = client.head(f"/v1/jobs/{job_id}/schedule", headers={**worker, "If-None-Match": '"1"'})
    assert r.status_code == 304 and r.headers["etag"] == '"1"'
    assert client.head("/v1/jobs/nope", headers=CTL).status_code == 404
    assert client.head("/v1/jobs").status_code == 401
    assert client.head(f"/v1/jobs/{job_id}/events", headers=CTL).status_code == 405


def test_worker_view(client: TestClient) -> None:
    job_id, worker = new_job(client)
    event(client, job_id, "f", "fail", [[1, 1]])
    full = client.get(f"/v1/jobs/{job_id}/schedule", headers=worker).json()["schedule"]
    hosts = {(ws["worker"][1], tuple(a["mb"])): tuple(ws["worker"]) for ws in full["workers"]
             for a in ws["actions"] if a["op"] == "F"}  # fmt: skip
    view = client.get(f"/v1/jobs/{job_id}/schedule?worker=0,1", headers=worker).json()
    assert view["alive"] and view["worker"] == [0, 1] and view["stage_alive"] == [[0, 1], [2, 1]]
    mine = next(ws for ws in full["workers"] if ws["worker"] == [0, 1])
    assert view["actions"] == mine["actions"]
    assert {tuple(r["mb"]) for r in view["routes"]} == {
        tuple(a["mb"]) for a in mine["actions"] if a["op"] == "F"
    }
    for route in view["routes"]:
        assert tuple(route["prev_host"]) == hosts[(0, tuple(route["mb"]))]
        assert route["next_host"] is None
    dead = client.get(f"/v1/jobs/{job_id}/schedule?worker=1,1", headers=worker).json()
    assert not dead["alive"] and dead["actions"] == []


def test_heartbeat_declares_silent_worker_failed(client: TestClient) -> None:
    import time

    job_id, worker = new_job(client)
    client.patch(f"/v1/jobs/{job_id}", json={"heartbeat_enabled": True}, headers=CTL)
    assert client.get(f"/v1/jobs/{job_id}/schedule?worker=2,0", headers=worker).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        doc = client.get(f"/v1/jobs/{job_id}", headers=CTL).json()
        if doc["failed"]:
            break
        time.sleep(0.1)
    assert doc["failed"] == [[2, 0]] and doc["version"] == 2


def test_heartbeat_switch_off_keeps_worker(client: TestClient) -> None:
    import time

    job_id, worker = new_job(client)  # heartbeat_enabled False
    client.get(f"/v1/jobs/{job_id}/schedule?worker=2,0", headers=worker)
    time.sleep(1.2)
    assert client.get(f"/v1/jobs/{job_id}", headers=CTL).json()["failed"] == []


def test_what_if_plan(client: TestClient) -> None:
    body = {"job": TINY, "scenario": {"failed": [[0, 0]]}, "time_limit_s": 1000, "use_cpsat": False}
    r = client.post("/v1/plan", json=body, headers=CTL)
    assert r.status_code == 200, r.text
    sched = Schedule.model_validate(r.json()["schedule"])
    assert sched.failed == [(0, 0)] and r.json()["figures"]["iteration_time_ms"] > 0
    body["scenario"] = {"failed": [[0, 0], [1, 0], [2, 0]]}
    r = client.post("/v1/plan", json=body, headers=CTL)
    assert r.status_code == 409 and r.json()["stages"] == [0]
    body["scenario"] = {"failed": [[7, 0]]}
    assert client.post("/v1/plan", json=body, headers=CTL).status_code == 422
    assert client.post("/v1/plan", json=body).status_code == 401


def scrape(client: TestClient) -> list[Sample]:
    """Every sample of GET /metrics, parsed by prometheus_client's own text parser."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
    return [s for family in text_string_to_metric_families(r.text) for s in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_health_ready_metrics_openapi(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.head("/healthz").status_code == 200 and client.head("/readyz").status_code == 200  # probes
    assert client.get("/readyz").status_code == 200
    text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # the names, types and help texts dashboards were built on (counters' samples end in _total)
    expected = {
        "recycle_http_request_duration_seconds": ("histogram", "HTTP request latency."),
        "recycle_solves": ("counter", "Planner solves by purpose and outcome."),
        "recycle_solve_duration_seconds": ("histogram", "Planner solve wall time."),
        "recycle_plan_cache": ("counter", "Event plan lookups by result (hit/miss)."),
        "recycle_schedule_versions": ("counter", "Schedule versions published."),
        "recycle_connected_pollers": ("gauge", "Schedule long-polls waiting now."),
        "recycle_jobs": ("gauge", "Jobs known to this process."),
        "recycle_heartbeat_failures": ("counter", "Workers declared failed for silence."),
    }
    assert {name: (families[name].type, families[name].documentation) for name in expected} == expected
    names = ["# TYPE recycle_solves_total counter", "recycle_http_request_duration_seconds_bucket{"]
    names += ["recycle_schedule_versions_total ", "recycle_connected_pollers ", "recycle_jobs "]
    assert all(name in text for name in names)
    requests = [
        s for s in families["recycle_http_request_duration_seconds"].samples if s.name.endswith("_count")
    ]
    assert requests and all(set(s.labels) == {"route", "method", "status"} for s in requests)
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/schedule",
            "/v1/plan", "/jobs/{job_id}"} <= set(paths)  # fmt: skip


def test_metrics_move_with_a_new_job_and_an_event(client: TestClient) -> None:
    events_route = {"route": "/v1/jobs/{job_id}/events", "method": "POST", "status": "200"}
    before = scrape(client)
    job_id, _ = new_job(client)
    created = scrape(client)
    assert total(created, "recycle_jobs") == total(before, "recycle_jobs") + 1
    assert (
        total(created, "recycle_schedule_versions_total")
        >= total(before, "recycle_schedule_versions_total") + 1
    )
    posts = {"route": "/v1/jobs", "method": "POST", "status": "201"}
    count = "recycle_http_request_duration_seconds_count"
    assert total(created, count, **posts) == total(before, count, **posts) + 1
    assert event(client, job_id, "metrics-f", "fail", [[2, 1]]).status_code == 200
    after = scrape(client)
    assert total(after, count, **events_route) == total(created, count, **events_route) + 1
    assert total(after, "recycle_http_request_duration_seconds_bucket", le="+Inf", **events_route) == total(
        after, count, **events_route
    )
    assert total(after, "recycle_plan_cache_total") >= total(created, "recycle_plan_cache_total") + 1
    assert (
        total(after, "recycle_schedule_versions_total")
        >= total(created, "recycle_schedule_versions_total") + 1
    )
    assert client.get(f"/v1/jobs/{job_id}", headers=CTL).json()["version"] == 2
    # every event-path solve is counted once and timed once
    solves = total(after, "recycle_solves_total", purpose="event")
    assert solves == total(after, "recycle_solve_duration_seconds_count", purpose="event")


def test_requests_answered_before_routing_count_under_their_route(client: TestClient) -> None:
    """A NaN 422 (answered by middleware), /openapi.json (a plain Starlette route) and a 405 were all
    counted under route="unmatched"; only a path no route serves is."""
    count = "recycle_http_request_duration_seconds_count"
    cases = [
        ("POST", "/v1/plan", '{"job": NaN}', {"route": "/v1/plan", "status": "422"}),
        ("GET", "/openapi.json", None, {"route": "/openapi.json", "status": "200"}),
        ("PUT", "/v1/plan", None, {"route": "/v1/plan", "status": "405"}),
        ("GET", "/no/such/path", None, {"route": "unmatched", "status": "404"}),
    ]
    for method, path, body, labels in cases:
        before = total(scrape(client), count, method=method, **labels)
        headers = {**CTL, "Content-Type": "application/json"}
        client.request(method, path, content=body, headers=headers)
        assert total(scrape(client), count, method=method, **labels) == before + 1, (method, path)


def test_metrics_in_multiprocess_mode(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR, counters add up over processes; a closed process's gauges go."""
    script = (
        "import sys\n"
        "from api.metrics import Metrics\n"
        "m = Metrics()\n"
        "m.solves.labels(purpose='event', source='greedy').inc()\n"
        "m.pollers.inc()\n"
        "sys.stdout.write(m.render().decode())\n"
        "if sys.argv[1] == 'close':\n"
        "    m.close()\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    root = Path(__file__).resolve().parents[1]
    outs = [
        subprocess.run([sys.executable, "-c", script, arg], env=env, cwd=root, capture_output=True, text=True)
        for arg in ("close", "stay")
    ]
    assert all(out.returncode == 0 for out in outs), [out.stderr for out in outs]
    last = [s for f in text_string_to_metric_families(outs[1].stdout) for s in f.samples]
    assert total(last, "recycle_solves_total", purpose="event", source="greedy") == 2
    assert total(last, "recycle_connected_pollers") == 1  # the first process closed: its poller is gone


def test_job_page(client: TestClient) -> None:
    job_id, worker = new_job(client)
    event(client, job_id, "f", "fail", [[1, 0]], reason="<script>x</script>")
    assert client.get(f"/jobs/{job_id}").status_code == 401
    r = client.get(f"/jobs/{job_id}", headers=worker)
    assert r.status_code == 200 and "<svg" in r.text and "[1, 0]" in r.text
    assert client.get(f"/jobs/{job_id}?token=controller-secret").status_code == 200
    assert "<script>x" not in r.text  # the page's own script only


def test_insecure_dev_and_refusal(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="controller token"):
        create_app(Settings(data_dir=tmp_path))
    app = create_app(Settings(data_dir=tmp_path, insecure_dev=True))
    with TestClient(app) as c:
        assert c.get("/v1/jobs/none").status_code == 404  # no auth asked at all
    assert json.loads(json.dumps(TINY))["name"] == "tiny-d3p2"
