"""/v1/jobs: register a job (idempotently with an Idempotency-Key), list jobs, read one, flip its
heartbeat switch."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response

from api.background import precompute
from api.deps import ControllerDep, ReaderDep, ServiceDep
from api.idempotency import check_key, key_hash, replayed_answer
from api.jobs import JobRuntime, JobService
from api.models import (
    JobCreate,
    JobCreated,
    JobList,
    JobPatch,
    JobStatus,
    JobSummary,
    Precompute,
    RestoreInfo,
)
from api.restore import restorable_iteration
from planner.contract_fields import unread_fields
from planner.errors import InvalidInputError

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

MAX_PAGE = 500

_CREATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    422: {"description": "Invalid job, or an Idempotency-Key already used with another body."}
}
_KEY_DOC = (
    "Makes a retried registration safe: the same key with the same body answers the first answer "
    "again (201, same body, header Idempotent-Replayed: true) instead of registering a second job; "
    "the same key with another body is 422. Use a random key (a UUID) per registration."
)


def job_status(service: JobService, rt: JobRuntime) -> JobStatus:
    """The public view of one job."""
    rec = rt.record
    view = rt.view
    return JobStatus(
        id=rec.id,
        name=rec.name,
        state=rec.state,  # type: ignore[arg-type]
        failed=list(rt.scenario.failed),
        slow=[s.model_dump(mode="json") for s in rt.scenario.slow],
        version=rec.version,
        source=None if view is None else view.source,
        iteration_time_ms=None if view is None else view.schedule["iteration_time_ms"],
        unrecoverable_stages=rec.unrecoverable_stages,
        max_failures=rec.max_failures,
        heartbeat_enabled=rec.heartbeat_enabled,
        heartbeat_timeout_s=rec.heartbeat_timeout_s or service.settings.heartbeat_timeout_s,
        precompute=Precompute(
            total=rec.precompute_total, done=rec.precompute_done, failed=rt.precompute_failed
        ),
        created_at=rec.created_at,
        done=sorted(rt.done),
        poll_wait_max_s=service.poll_wait_cap(rt),
        restore_policy=rec.restore_policy,  # type: ignore[arg-type]
        repartition=rec.repartition,
        restore=None if rec.restore is None else RestoreInfo.model_validate(rec.restore),
        checkpoints=rec.checkpoints,
        restorable_iteration=restorable_iteration(rec.checkpoints, rt.job.num_stages),
        job=rt.job,
    )


def _start_precompute(request: Request, service: JobService, rt: JobRuntime) -> None:
    """Start the job's background precompute unless a task for it is already running."""
    tasks: set[asyncio.Task[None]] = request.app.state.tasks
    name = f"precompute-{rt.record.id}"
    if any(t.get_name() == name and not t.done() for t in tasks):
        return
    task = asyncio.create_task(precompute(service, rt), name=name)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


@router.post("", status_code=201, response_model=JobCreated, responses=_CREATE_RESPONSES)
async def create_job(
    body: JobCreate,
    service: ServiceDep,
    _: ControllerDep,
    request: Request,
    response: Response,
    idempotency_key: Annotated[str | None, Header(description=_KEY_DOC)] = None,
) -> JobCreated:
    """Register a job; its workers authenticate with the returned worker token (shown only once,
    and again to a retry with the same Idempotency-Key)."""
    if idempotency_key is not None:
        check_key(idempotency_key)
        old = service.store.get_idempotency(key_hash(idempotency_key))
        if old is not None:
            answer = replayed_answer(old, idempotency_key, body)
            rt = service.get(old.job_id)
            await service.ensure_version(rt)  # the first attempt may still run
            if rt.record.precompute_total == 0:  # the first attempt may have failed before starting it
                _start_precompute(request, service, rt)
            response.headers["Idempotent-Replayed"] = "true"
            return answer
    rt, token = await service.create(body, idempotency_key)
    _start_precompute(request, service, rt)
    warnings = unread_fields(body.job, "job.")
    return JobCreated(id=rt.record.id, worker_token=token, version=1, state="running", warnings=warnings)


@router.get("", response_model=JobList)
async def list_jobs(
    service: ServiceDep,
    _: ControllerDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"Page size (at most {MAX_PAGE}).")] = 50,
    cursor: Annotated[
        str | None, Query(description="next_cursor of the previous page: jobs older than it.")
    ] = None,
) -> JobList:
    """Every job, newest first (controller only): id, registration time, state, version, D x P and
    failed workers, a page at a time."""
    order = sorted(service.jobs.values(), key=lambda rt: (rt.record.created_at, rt.record.id), reverse=True)
    if cursor is not None:
        after = service.jobs.get(cursor)
        if after is None:
            raise InvalidInputError(f"cursor: {cursor!r} is not a job id from a previous page")
        mark = (after.record.created_at, after.record.id)
        order = [rt for rt in order if (rt.record.created_at, rt.record.id) < mark]
    page = order[:limit]
    jobs = [
        JobSummary(
            id=rt.record.id,
            name=rt.record.name,
            created_at=rt.record.created_at,
            state=rt.record.state,  # type: ignore[arg-type]
            version=rt.record.version,
            num_pipelines=rt.job.num_pipelines,
            num_stages=rt.job.num_stages,
            failed=list(rt.scenario.failed),
        )
        for rt in page
    ]
    more = len(order) > limit
    return JobList(jobs=jobs, next_cursor=page[-1].record.id if more else None)


@router.get("/{job_id}", response_model=JobStatus)
async def get_job(job_id: str, service: ServiceDep, _: ReaderDep) -> JobStatus:
    """State, failure set, current version and precompute progress."""
    return job_status(service, service.get(job_id))


@router.patch("/{job_id}", response_model=JobStatus)
async def patch_job(job_id: str, body: JobPatch, service: ServiceDep, _: ControllerDep) -> JobStatus:
    """Turn heartbeat failure detection on or off, or change its timeout, for this job."""
    rt = service.get(job_id)
    service.set_switches(rt, body.heartbeat_enabled, body.heartbeat_timeout_s)
    return job_status(service, rt)
