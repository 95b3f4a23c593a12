"""The one place where planner and service errors become HTTP statuses.

Domain code (planner/, api/jobs.py) raises its own exception types; install_error_handlers()
registers the mapping: invalid input 422, unknown job 404, unrecoverable failure set 409 (naming
the stage and saying to restore from a checkpoint), conflicting event_id 409, an event for a
finished job 409, `done` from a worker the job has as failed 409, an Idempotency-Key reused for
another body 422, planner bug 500, solver overload 503, database unreachable (PostgreSQL down or
restarting, hanging, no free connection) or a version another replica committed first 503 with
Retry-After: 1 (retry). Routing and auth errors (401, 403, an unknown path 404, 405) get the same
`{"detail", "error"}` shape.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api.records import StoreUnavailableError, VersionConflictError
from api.validation import install_validation
from planner.errors import InvalidInputError, ScheduleRuleError, UnrecoverableScenarioError


class ServiceError(Exception):
    """Base of the service's own domain errors."""


class JobNotFoundError(ServiceError):
    """No job with that id."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(f"no job {job_id!r}")


class EventConflictError(ServiceError):
    """An event_id was reused with a different body."""


class JobFinishedError(ServiceError):
    """An event for a job whose every alive worker reported `done` (nothing left to change)."""


class WorkerFailedError(ServiceError):
    """A `done` from a worker the job has as failed: its work does not count."""


class IdempotencyConflictError(ServiceError):
    """An Idempotency-Key was reused with a different POST /v1/jobs body."""


class SolverBusyError(ServiceError):
    """A solve did not finish within its time limit plus grace."""


def _unrecoverable(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, UnrecoverableScenarioError)
    return JSONResponse(
        status_code=409,
        content={
            "detail": str(exc),
            "error": "unrecoverable",
            "stages": exc.stages,
            "action": "restore from checkpoint",
        },
    )


def _simple(status: int, error: str, retry_after_s: int | None = None):  # type: ignore[no-untyped-def]
    headers = None if retry_after_s is None else {"Retry-After": str(retry_after_s)}

    def handler(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=status, content={"detail": str(exc), "error": error}, headers=headers)

    return handler


METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
HTTP_ERRORS = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}


def _allowed(request: Request) -> list[str]:
    """The methods some route of the app takes on this request's path (asked of the router itself,
    so routers included in others count)."""
    routes = request.app.router.routes

    def takes(method: str) -> bool:
        return any(r.matches({**request.scope, "method": method})[0] == Match.FULL for r in routes)

    taken = {m for m in METHODS if takes(m)}
    if "GET" in taken:  # HEAD is answered wherever GET is (middleware.HeadMiddleware)
        taken.add("HEAD")
    return [m for m in METHODS if m in taken]


def _http(request: Request, exc: Exception) -> JSONResponse:
    """The routing and auth errors in the service's own shape (`detail` and `error`). A path no route
    serves is `404 unknown_path`; a method no route of the path takes is `405` with `Allow` listing
    the methods of every route of that path (Starlette named the first route's only)."""
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    error = HTTP_ERRORS.get(exc.status_code, "http_error")
    detail = str(exc.detail)
    path = request.url.path
    if exc.status_code == 404 and detail == "Not Found":
        error, detail = "unknown_path", f"no route serves {path}"
    elif exc.status_code == 405:
        headers["Allow"] = ", ".join(_allowed(request))
        detail = f"{request.method} is not allowed on {path} (allowed: {headers['Allow']})"
    content = {"detail": detail, "error": error}
    return JSONResponse(status_code=exc.status_code, content=content, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Register every domain-error -> HTTP status mapping on `app`."""
    app.add_exception_handler(UnrecoverableScenarioError, _unrecoverable)
    app.add_exception_handler(InvalidInputError, _simple(422, "invalid"))
    app.add_exception_handler(JobNotFoundError, _simple(404, "not_found"))
    app.add_exception_handler(EventConflictError, _simple(409, "event_conflict"))
    app.add_exception_handler(JobFinishedError, _simple(409, "job_finished"))
    app.add_exception_handler(WorkerFailedError, _simple(409, "worker_failed"))
    app.add_exception_handler(IdempotencyConflictError, _simple(422, "idempotency_key_reused"))
    app.add_exception_handler(SolverBusyError, _simple(503, "solver_busy"))
    app.add_exception_handler(StoreUnavailableError, _simple(503, "database_unavailable", 1))
    app.add_exception_handler(VersionConflictError, _simple(503, "version_conflict", 1))
    app.add_exception_handler(ScheduleRuleError, _simple(500, "planner_bug"))
    app.add_exception_handler(StarletteHTTPException, _http)
    install_validation(app)  # 422 naming the field for NaN/Infinity in a body, never echoing them
