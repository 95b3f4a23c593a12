"""api/fastpoll.py answers a schedule poll exactly as the FastAPI route does, or declines it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.types import Receive, Scope, Send

from api.fastpoll import answer_poll
from api.main import create_app
from api.settings import Settings
from tests.test_api_endpoints import CTL, TINY

pytestmark = pytest.mark.timeout(120)

SERVED: list[bool] = []


def dual(app: FastAPI) -> Any:
    """The app, where a request with `x-path: route` skips the fast path (the reference answer)."""

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (b"x-path", b"route") in scope["headers"]:
            await FastAPI.__call__(app, scope, receive, send)
            return
        if scope["type"] == "http":
            served = await answer_poll(app, scope, receive, send)
            SERVED.append(served)
            if served:
                return
        await app(scope, receive, send)

    return asgi


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, dict[str, Any]]]:
    cfg = Settings(
        data_dir=tmp_path_factory.mktemp("data"),
        controller_token="controller-secret",  # type: ignore[arg-type]
        precompute_time_limit_s=1.0,
        refine_time_limit_s=1.0,
        max_wait_s=0.2,
    )
    app = create_app(cfg)
    with TestClient(dual(app)) as c:
        ids = {}
        for name in ("a", "b"):
            job = {"job": TINY, "heartbeat_enabled": False, "max_failures": 0}  # nothing to precompute
            r = c.post("/v1/jobs", json=job, headers=CTL)
            assert r.status_code == 201
            ids[name] = (r.json()["id"], {"Authorization": f"Bearer {r.json()['worker_token']}"})
        body = {"event_id": "f1", "kind": "fail", "workers": [[1, 1]]}
        assert c.post(f"/v1/jobs/{ids['a'][0]}/events", json=body, headers=CTL).status_code == 200
        service = app.state.service
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # no version may appear between the two fetches of a test
            pre = [c.get(f"/v1/jobs/{i}", headers=CTL).json()["precompute"] for i, _ in ids.values()]
            if not service._tasks and all(p["total"] and p["done"] >= p["total"] for p in pre):
                break
            time.sleep(0.1)
        yield c, ids


def compare(c: TestClient, url: str, headers: dict[str, str]) -> bool:
    """Fetch `url` both ways; assert the same answer; True when the fast path served it."""
    SERVED.clear()
    fast = c.get(url, headers=headers)
    served = SERVED == [True]
    slow = c.get(url, headers={**headers, "x-path": "route"})
    assert (fast.status_code, fast.content) == (slow.status_code, slow.content), url
    for h in ("etag", "content-type", "content-length", "www-authenticate"):
        assert fast.headers.get(h) == slow.headers.get(h), (url, h)
    return served


def test_plain_polls_are_served_and_equal(ctx: tuple[TestClient, dict[str, Any]]) -> None:
    c, ids = ctx
    job, worker = ids["a"]
    base = f"/v1/jobs/{job}/schedule"
    v = c.get(f"/v1/jobs/{job}", headers=CTL).json()["version"]
    queries = [
        "",
        "?worker=0,1",
        "?worker=1,1",
        "?worker=2,0&after_version=1",
        f"?after_version={v}&wait=0.05",
        "?after_version=0&wait=0",
        "?worker=0,0&wait=0.01&after_version=99&extra=1",
    ]
    inm = [{"If-None-Match": f'"{v}"'}, {"If-None-Match": 'W/"1"'}]
    for query in queries:
        for headers in (worker, CTL, {**worker, **inm[0]}, {**CTL, **inm[1]}):
            assert compare(c, base + query, headers), (query, headers)
    assert c.get(base + f"?after_version={v}&wait=0.01", headers=worker).status_code == 304
    # "*" matches any current version (RFC 9110): it answered the whole schedule again.
    assert compare(c, base, {**worker, "If-None-Match": "*"})
    assert c.get(base, headers={**worker, "If-None-Match": "*"}).status_code == 304


def test_errors_are_left_to_the_route(ctx: tuple[TestClient, dict[str, Any]]) -> None:
    c, ids = ctx
    job, worker = ids["a"]
    other_worker = ids["b"][1]
    base = f"/v1/jobs/{job}/schedule"
    cases = [
        (base, {}),
        (base, {"Authorization": "Bearer nope"}),
        (base, {"Authorization": "Basic abc"}),
        (base, other_worker),
        ("/v1/jobs/nope/schedule", CTL),
        (base + "?worker=3,0", worker),
        (base + "?worker=0,2", worker),
        (base + "?worker=a,b", worker),
        (base + "?worker=+1,0", worker),
        (base + "?worker=0,1&worker=1,0", worker),
        (base + "?after_version=-1", worker),
        (base + "?wait=-1", worker),
        (base + "?wait=nan", worker),  # 422 "a finite number", not ">= 0"
        (base + "?wait=inf", worker),
        (base + "?wait=1e-3", worker),
        (base + "?after_version=", worker),
    ]
    for url, headers in cases:
        served = compare(c, url, headers)
        assert not served, url
    r = c.get(base + "?wait=nan", headers=worker)
    assert r.status_code == 422 and "finite" in r.json()["detail"][0]["msg"], r.text


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    worker=st.one_of(st.none(), st.from_regex(r"\A-?[0-9+ ]{0,2},[0-9 ]{0,2}\Z")),
    after=st.one_of(st.none(), st.from_regex(r"\A[0-9.-]{0,3}\Z")),
    wait=st.one_of(st.none(), st.from_regex(r"\A[0-9.e-]{0,4}\Z")),
    inm=st.one_of(st.none(), st.sampled_from(['"1"', '"2"', 'W/"3"', "*", "x"])),
)
def test_any_query_answers_the_same_both_ways(
    ctx: tuple[TestClient, dict[str, Any]],
    worker: str | None,
    after: str | None,
    wait: str | None,
    inm: str | None,
) -> None:
    c, ids = ctx
    job, token = ids["a"]
    given = (("worker", worker), ("after_version", after), ("wait", wait))
    params = {k: v for k, v in given if v is not None}
    query = "&".join(f"{k}={v}" for k, v in params.items())
    headers = dict(token) if inm is None else {**token, "If-None-Match": inm}
    compare(c, f"/v1/jobs/{job}/schedule?{query}", headers)
