"""/v1/jobs/{id}/events: failures, rejoins and slow workers reported by the controller."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.deps import ControllerDep, ServiceDep
from api.models import EventIn, EventResult
from planner.errors import UnrecoverableScenarioError

router = APIRouter(prefix="/v1/jobs", tags=["events"])

_409: dict[int | str, dict[str, Any]] = {
    409: {"description": "Unrecoverable failure set (names the stage), or event_id reused with another body."}
}


@router.post("/{job_id}/events", response_model=EventResult, responses=_409)
async def post_event(job_id: str, body: EventIn, service: ServiceDep, _: ControllerDep) -> EventResult:
    """Apply an event once (idempotent by event_id) and publish the next schedule version."""
    result, lost_stages = await service.apply_event(job_id, body)
    if lost_stages:
        raise UnrecoverableScenarioError(lost_stages)
    return EventResult.model_validate(result)
