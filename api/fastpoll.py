"""The schedule long-poll answered without FastAPI's routing and dependency injection.

Every worker polls GET /v1/jobs/{id}/schedule, so that request dominates the service's CPU:
through FastAPI (middleware stack, route matching, dependency solving, parameter validation) it
costs about 1 ms of CPU, several times the poll itself. answer_poll() serves the well-formed,
authorized polls directly and declines (returns False, having sent nothing) everything else: bad
or missing credentials, another job's worker token, an unknown job, a malformed or off-grid
`worker`, unusual parameter spellings, a request body. Declined requests go through the FastAPI
route in api/routes/schedule.py, which gives every error answer as before; both paths share
long_poll(), so a served poll answers exactly what the route would. The route stays in the
OpenAPI document.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

from fastapi import HTTPException
from starlette.types import Receive, Scope, Send

from api.deps import authenticate
from api.records import StoreUnavailableError
from api.routes.schedule import WAIT_HEADER, etag_version, long_poll

if TYPE_CHECKING:
    from fastapi import FastAPI

    from api.jobs import JobService

ROUTE = "/v1/jobs/{job_id}/schedule"  # the route template, as the timing middleware labels it

_PATH = re.compile(r"/v1/jobs/([^/]+)/schedule")
_WORKER = re.compile(r"(\d{1,6}),(\d{1,6})")
_INT = re.compile(r"\d{1,18}")
_FLOAT = re.compile(r"\d{1,9}(\.\d{1,9})?")
_QUERY_KEYS = {"worker", "after_version", "wait"}
_WAIT_HEADER = WAIT_HEADER.lower().encode()


def _headers(scope: Scope) -> dict[bytes, bytes] | None:
    """The request headers the poll reads, or None when the request has a body or repeats one."""
    out: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in (b"content-length", b"transfer-encoding"):
            return None
        if name in (b"authorization", b"if-none-match"):
            if name in out:
                return None
            out[name] = value
    return out


def _query(scope: Scope) -> dict[str, str] | None:
    """The poll's query parameters in their plain spellings, or None when the route should judge them."""
    params: dict[str, str] = {}
    for key, value in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True):
        if key not in _QUERY_KEYS:
            continue
        if key in params:
            return None
        pattern = _WORKER if key == "worker" else _INT if key == "after_version" else _FLOAT
        if pattern.fullmatch(value) is None:
            return None
        params[key] = value
    return params


async def answer_poll(app: FastAPI, scope: Scope, receive: Receive, send: Send) -> bool:
    """Serve `scope` if it is a plain, authorized schedule poll; False (nothing sent) otherwise."""
    if scope["method"] != "GET":
        return False
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    match = _PATH.fullmatch(path)
    if match is None:
        return False
    service: JobService | None = getattr(app.state, "service", None)
    headers = _headers(scope)
    params = _query(scope)
    if service is None or headers is None or params is None:
        return False
    t0 = time.perf_counter()
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    try:
        principal = authenticate(token if scheme.lower() == "bearer" else None, service.settings, service)
    except (HTTPException, StoreUnavailableError):  # the route answers (401, or 503 without the database)
        return False
    job_id = match.group(1)
    rt = service.jobs.get(job_id)
    if rt is None or (principal.role == "worker" and principal.job_id != job_id):
        return False
    w = None
    if "worker" in params:
        d, s = (int(x) for x in params["worker"].split(","))
        if not (d < rt.job.num_pipelines and s < rt.job.num_stages):
            return False
        w = (d, s)
    inm = headers.get(b"if-none-match")
    named = etag_version(None if inm is None else inm.decode("latin-1"), rt.version)
    after = max(int(params.get("after_version", "0")), named)
    wait = float(params.get("wait", "0"))
    beat = principal.token_job == job_id
    body, etag, most = await long_poll(service, rt, w, after, wait, receive, heartbeat=beat)
    raw: list[tuple[bytes, bytes]] = [(b"etag", etag.encode()), (_WAIT_HEADER, most.encode())]
    if body is not None:
        raw += [(b"content-length", b"%d" % len(body)), (b"content-type", b"application/json")]
    status = 304 if body is None else 200
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body or b""})
    service.metrics.request_seconds.labels(route=ROUTE, method="GET", status=str(status)).observe(
        time.perf_counter() - t0
    )
    return True
