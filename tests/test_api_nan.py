"""NaN, Infinity and -Infinity in a JSON body: 422 naming the field for every endpoint that takes a body,
never 500 (issue 11, "Bad input"). Python's json accepts those tokens; JSON does not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient

from api.main import create_app
from api.models import EventIn
from api.settings import Settings
from api.validation import non_finite_paths, safe_errors, validation_error_handler
from tests.jobs import service_job_doc

pytestmark = pytest.mark.timeout(120)

CTL = {"Authorization": "Bearer controller-secret", "Content-Type": "application/json"}
TOKENS = ["NaN", "Infinity", "-Infinity", "1e999"]
JOB: dict[str, Any] = service_job_doc(2, 2, 2)
SLOW = {"event_id": "s", "kind": "slow", "workers": [[0, 0]], "factor": 1.5}

# (method, path template, body, path of a numeric field in it): every endpoint with a JSON body.
CASES: list[tuple[str, str, dict[str, Any], list[str | int]]] = [
    ("POST", "/v1/jobs", {"job": JOB}, ["job", "stages", 0, "forward"]),
    ("POST", "/v1/jobs", {"job": JOB}, ["job", "comm", "allreduce_ms"]),
    ("POST", "/v1/jobs", {"job": JOB, "heartbeat_timeout_s": 5.0}, ["heartbeat_timeout_s"]),
    ("POST", "/v1/jobs", {"job": JOB, "max_failures": 1}, ["max_failures"]),
    ("PATCH", "/v1/jobs/{job_id}", {"heartbeat_timeout_s": 5.0}, ["heartbeat_timeout_s"]),
    ("POST", "/v1/jobs/{job_id}/events", SLOW, ["factor"]),
    ("POST", "/v1/plan", {"job": JOB, "time_limit_s": 1.0}, ["time_limit_s"]),
    ("POST", "/v1/plan", {"job": JOB}, ["job", "stages", 1, "optimizer"]),
    ("POST", "/v1/plan", {"job": JOB, "scenario": {"slow": [{"worker": [0, 1], "factor": 2.0}]}},
     ["scenario", "slow", 0, "factor"]),
]  # fmt: skip


def strict_json(text: str) -> Any:
    """Parse an answer as JSON proper: a NaN/Infinity token in it is an error."""

    def refuse(token: str) -> None:
        raise AssertionError(f"the answer holds the non-JSON token {token}: {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def with_token(body: dict[str, Any], path: list[str | int], token: str) -> str:
    """`body` as JSON text with the value at `path` replaced by the raw `token`."""
    doc = json.loads(json.dumps(body))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = "@@TOKEN@@"
    text = json.dumps(doc)
    assert text.count('"@@TOKEN@@"') == 1
    return text.replace('"@@TOKEN@@"', token)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("data"),
        controller_token="controller-secret",  # type: ignore[arg-type]
        precompute_time_limit_s=0.5,
        refine_time_limit_s=0.5,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def job_id(client: TestClient) -> str:
    r = client.post("/v1/jobs", json={"job": JOB, "heartbeat_enabled": False, "max_failures": 0}, headers=CTL)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_cases_cover_every_endpoint_with_a_body(client: TestClient) -> None:
    """A new endpoint that takes a body (a requestBody in the OpenAPI document) must get a case here."""
    paths = client.get("/openapi.json").json()["paths"]
    with_body = {
        (method.upper(), path)
        for path, operations in paths.items()
        for method, operation in operations.items()
        if "requestBody" in operation
    }
    assert with_body == {(m, p) for m, p, _, _ in CASES}


@pytest.mark.parametrize("token", TOKENS)
@pytest.mark.parametrize(("method", "path", "body", "field"), CASES, ids=lambda x: str(x)[:40])
def test_non_finite_number_is_422_naming_the_field(
    client: TestClient,
    job_id: str,
    token: str,
    method: str,
    path: str,
    body: dict[str, Any],
    field: list[Any],
) -> None:
    r = client.request(
        method, path.format(job_id=job_id), content=with_token(body, field, token), headers=CTL
    )
    assert r.status_code == 422, r.text
    answer = strict_json(r.text)
    assert answer["error"] == "invalid"
    assert [e["loc"] for e in answer["detail"]] == [["body", *field]]
    assert "finite" in answer["detail"][0]["msg"]


def test_every_non_finite_field_is_named(client: TestClient, job_id: str) -> None:
    text = with_token({"job": JOB, "heartbeat_timeout_s": 1.0}, ["heartbeat_timeout_s"], "NaN")
    text = text.replace('"forward": 1.0', '"forward": -Infinity', 1)
    r = client.post("/v1/jobs", content=text, headers=CTL)
    assert r.status_code == 422, r.text
    locs = [e["loc"] for e in strict_json(r.text)["detail"]]
    assert locs == [["body", "heartbeat_timeout_s"], ["body", "job", "stages", 0, "forward"]]


def test_finite_bodies_still_pass(client: TestClient, job_id: str) -> None:
    """The check replays the body it read: ordinary requests are served as before, and the
    tokens inside strings are text, not numbers."""
    body = {"event_id": "ok-1", "kind": "slow", "workers": [[0, 0]], "factor": 1.5, "reason": "NaN Infinity"}
    r = client.post(f"/v1/jobs/{job_id}/events", content=json.dumps(body), headers=CTL)
    assert r.status_code == 200, r.text
    r = client.patch(f"/v1/jobs/{job_id}", json={"heartbeat_timeout_s": 1e300}, headers=CTL)
    assert r.status_code == 422 and strict_json(r.text)["detail"][0]["loc"] == ["body", "heartbeat_timeout_s"]
    r = client.post(f"/v1/jobs/{job_id}/events", content=b"{not json", headers=CTL)
    assert r.status_code == 422 and strict_json(r.text)["detail"][0]["type"] == "json_invalid"
    assert strict_json(r.text)["error"] == "invalid", r.text


def test_a_body_of_another_content_type_is_named_not_echoed(client: TestClient, job_id: str) -> None:
    """curl -d sends a form: the 422 named a dictionary and echoed the whole body back."""
    body = json.dumps({"event_id": "form-1", "kind": "fail", "workers": [[0, 0]], "reason": "x" * 5000})
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        headers = {**CTL, "Content-Type": kind}
        r = client.post(f"/v1/jobs/{job_id}/events", content=body, headers=headers)
        assert r.status_code == 422 and len(r.text) < 500, r.text
        assert "Content-Type: application/json" in r.json()["detail"][0]["msg"], r.text
        assert r.json()["error"] == "invalid", r.text


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ('{"event_id": "\\ud800", "kind": "fail", "workers": [[0, 0]]}', ["body", "event_id"]),
        ('{"\\udc00x": 1, "event_id": "e", "kind": "fail", "workers": [[0, 0]]}', ["body"]),
        ('{"event_id": "e", "kind": "fail", "workers": [[0, 0]], "why\\ud800": "\\ud800"}', ["body"]),
    ],
)
def test_a_lone_surrogate_is_422_naming_it(
    client: TestClient, job_id: str, body: str, loc: list[str]
) -> None:
    """JSON's \\u escapes can spell a lone UTF-16 surrogate, which is no Unicode text: the 422 that
    echoed it failed to render and the client got a plain-text 500."""
    r = client.post(f"/v1/jobs/{job_id}/events", content=body.encode(), headers=CTL)
    assert r.status_code == 422, r.text
    doc = strict_json(r.text)
    assert doc["error"] == "invalid" and doc["detail"][0]["loc"] == loc, r.text
    assert "surrogate" in doc["detail"][0]["msg"], r.text


def test_safe_errors_escapes_what_utf8_cannot_encode() -> None:
    raw = {"type": "extra_forbidden", "loc": ("body", "k\ud800"), "msg": "m", "input": "\udfff"}
    (error,) = safe_errors([raw])
    assert error["loc"] == ["body", "k\\ud800"] and error["input"] == "\\udfff"
    json.dumps(error).encode()


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("POST", "/v1/jobs", {"job": JOB, "max_failures": "2"}, "max_failures"),
        ("POST", "/v1/jobs", {"job": JOB, "heartbeat_enabled": "yes"}, "heartbeat_enabled"),
        ("POST", "/v1/jobs", {"job": JOB, "heartbeat_timeout_s": "5"}, "heartbeat_timeout_s"),
        ("PATCH", "/v1/jobs/{job_id}", {"heartbeat_enabled": 1}, "heartbeat_enabled"),
        ("POST", "/v1/jobs/{job_id}/events", {**SLOW, "factor": "1.5"}, "factor"),
        ("POST", "/v1/jobs/{job_id}/events", {"event_id": "c", "kind": "checkpoint", "workers": [[0, 0]],
                                              "iteration": "3"}, "iteration"),
        ("POST", "/v1/plan", {"job": JOB, "use_cpsat": "false"}, "use_cpsat"),
    ],
)  # fmt: skip
def test_request_fields_are_strict(
    client: TestClient, job_id: str, method: str, path: str, body: dict[str, Any], field: str
) -> None:
    """`"2"` is no integer and `"yes"` no boolean: pydantic's lax mode read `"false"` as False and
    `"yes"` as True (outside review, session 14)."""
    r = client.request(method, path.format(job_id=job_id), json=body, headers=CTL)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][-1] == field, r.text


@pytest.mark.parametrize(
    ("body", "why"),
    [(b'{"event_id": "\xff\xfe"}', "not UTF-8 text"), (b"[" * 100_000 + b"]" * 100_000, "too deeply")],
)
def test_an_unreadable_body_is_a_json_invalid_422(
    client: TestClient, job_id: str, body: bytes, why: str
) -> None:
    """FastAPI answered these 400 "There was an error parsing the body", a status the API does not
    document for them."""
    r = client.post(f"/v1/jobs/{job_id}/events", content=body, headers=CTL)
    assert r.status_code == 422, r.text
    (error,) = strict_json(r.text)["detail"]
    assert error["type"] == "json_invalid" and error["loc"] == ["body"] and why in error["msg"], r.text


def test_non_finite_paths() -> None:
    assert non_finite_paths(b'{"a": [1, {"b": NaN}], "c": 1e999, "d": "NaN"}') == [["a", 1, "b"], ["c"]]
    assert non_finite_paths(b"Infinity") == [[]]
    assert non_finite_paths(b'{"a": 1.5}') == []
    assert non_finite_paths(b"{nope") is None


def test_handler_alone_never_echoes_a_non_finite_input() -> None:
    """The 422 handler without the body check (a non-finite value that reached validation some other
    way): FastAPI's own handler answered 500 here, as it could not encode the echoed input."""
    app = FastAPI()

    @app.post("/e")
    async def post_event(body: EventIn) -> dict[str, str]:
        return {"ok": body.event_id}

    app.add_exception_handler(RequestValidationError, validation_error_handler)
    text = '{"event_id": "x", "kind": "slow", "workers": [[0, 0]], "factor": NaN}'
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/e", content=text, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    (error,) = strict_json(r.text)["detail"]
    assert error["loc"] == ["body", "factor"] and "input" not in error and "finite" in error["msg"]


def test_safe_errors_keeps_finite_inputs() -> None:
    errors = [
        {
            "type": "greater_than",
            "loc": ("body", "factor"),
            "msg": "m",
            "input": float("inf"),
            "ctx": {"gt": 0},
        },
        {
            "type": "less_than_equal",
            "loc": ("body", "factor"),
            "msg": "m",
            "input": 2000.0,
            "ctx": {"le": 1000},
        },
        {
            "type": "x",
            "loc": ("body",),
            "msg": "m",
            "input": {"factor": float("-inf")},
            "ctx": {"v": float("nan")},
        },
    ]
    out = safe_errors(errors)
    assert "input" not in out[0] and out[0]["ctx"] == {"gt": 0} and "finite" in out[0]["msg"]
    assert out[1]["input"] == 2000.0 and out[1]["msg"] == "m"
    assert "input" not in out[2] and "ctx" not in out[2] and out[2]["msg"] == "m"
    json.dumps(out, allow_nan=False)
