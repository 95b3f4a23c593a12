"""/v1/jobs: register a job, read its state, flip its heartbeat switch."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from api.background import precompute
from api.deps import ControllerDep, ReaderDep, ServiceDep
from api.jobs import JobRuntime, JobService
from api.models import JobCreate, JobCreated, JobPatch, JobStatus, Precompute

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


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
        precompute=Precompute(total=rec.precompute_total, done=rec.precompute_done),
        created_at=rec.created_at,
    )


@router.post("", status_code=201, response_model=JobCreated)
async def create_job(body: JobCreate, service: ServiceDep, _: ControllerDep, request: Request) -> JobCreated:
    """Register a job; its workers authenticate with the returned worker token (shown only once)."""
    rt, token = await service.create(body)
    tasks: set[asyncio.Task[None]] = request.app.state.tasks
    task = asyncio.create_task(precompute(service, rt))
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return JobCreated(id=rt.record.id, worker_token=token, version=rt.version, state=rt.record.state)


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
