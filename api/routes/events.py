"""/v1/jobs/{id}/events: failures, rejoins and slow workers reported by the controller, and `done`
from the job's workers (or the controller) when they completed their iterations."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from api.deps import ReaderDep, ServiceDep
from api.models import EventIn, EventResult
from planner.errors import UnrecoverableScenarioError

router = APIRouter(prefix="/v1/jobs", tags=["events"])

_RESPONSES: dict[int | str, dict[str, Any]] = {
    403: {"description": "A worker token posting another kind than `done`, or for another job."},
    409: {
        "description": "Unrecoverable failure set (names the stage); event_id reused with another body; "
        "the job is finished (error: job_finished); `done` from a worker the job has as failed "
        "(error: worker_failed)."
    },
}


@router.post("/{job_id}/events", response_model=EventResult, responses=_RESPONSES)
async def post_event(job_id: str, body: EventIn, service: ServiceDep, principal: ReaderDep) -> EventResult:
    """Apply an event once (idempotent by event_id) and publish the next schedule version.

    The controller posts any kind; the job's worker token only `done` (a worker that completed its
    iterations, before it stops polling)."""
    if principal.role != "controller" and body.kind != "done":
        raise HTTPException(403, "a worker token may only post `done` events and read its job")
    result, lost_stages = await service.apply_event(job_id, body)
    if lost_stages:
        raise UnrecoverableScenarioError(lost_stages)
    return EventResult.model_validate(result)
