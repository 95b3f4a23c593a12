"""/v1/jobs/{id}/events: failures, rejoins, slow workers, checkpoints and `done`, reported by the
controller or with the job's own worker token (an agent on a host has only that one)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.deps import ReaderDep, ServiceDep
from api.models import EventIn, EventResult
from planner.errors import UnrecoverableScenarioError

router = APIRouter(prefix="/v1/jobs", tags=["events"])

_RESPONSES: dict[int | str, dict[str, Any]] = {
    403: {"description": "A worker token of another job."},
    409: {
        "description": "Unrecoverable failure set with restore policy manual (names the stage; with "
        "policy auto the job is restored at once and the answer is 200 with `restore`); event_id reused "
        "with another body; the job is finished (error: job_finished); `done` or `checkpoint` from a "
        "worker the job has as failed (error: worker_failed)."
    },
}


@router.post("/{job_id}/events", response_model=EventResult, responses=_RESPONSES)
async def post_event(job_id: str, body: EventIn, service: ServiceDep, _: ReaderDep) -> EventResult:
    """Apply an event once (idempotent by event_id) and publish the next schedule version (none for
    `done` and `checkpoint`). The controller and the job's worker token may post every kind."""
    result, lost_stages = await service.apply_event(job_id, body)
    if lost_stages:
        raise UnrecoverableScenarioError(lost_stages)
    return EventResult.model_validate(result)
