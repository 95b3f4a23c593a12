"""/v1/jobs/{id}/schedule: the long-poll workers use. A poll with `worker` and the job's worker token is
that worker's heartbeat; a controller-token poll never is."""

from __future__ import annotations

import asyncio
import time
from asyncio import FIRST_COMPLETED
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from starlette.types import Receive

from api.deps import ReaderDep, ServiceDep
from api.jobs import JobRuntime, JobService
from api.models import ScheduleEnvelope, WorkerView
from api.views import VersionView
from planner.errors import InvalidInputError

router = APIRouter(prefix="/v1/jobs", tags=["schedule"])


def parse_worker(text: str, rt: JobRuntime) -> tuple[int, int]:
    """`d,s` -> (d, s) inside the job's grid, else InvalidInputError."""
    try:
        d_text, s_text = text.split(",")
        d, s = int(d_text), int(s_text)
    except ValueError:
        raise InvalidInputError(f"worker: {text!r} is not 'd,s'") from None
    if not (0 <= d < rt.job.num_pipelines and 0 <= s < rt.job.num_stages):
        raise InvalidInputError(
            f"worker: [{d}, {s}] is outside the job's grid "
            f"({rt.job.num_pipelines} pipelines x {rt.job.num_stages} stages)"
        )
    return d, s


def etag_version(if_none_match: str | None) -> int:
    """The version an If-None-Match header names ("7", W/"7"), 0 when none or not a version."""
    if not if_none_match:
        return 0
    text = if_none_match.strip().removeprefix("W/").strip('"')
    return int(text) if text.isdigit() else 0


class ClientGone(Exception):
    """The poller closed its connection while waiting (a killed worker's socket is closed by its kernel)."""


async def until_disconnect(receive: Receive) -> None:
    """Return once the ASGI server reports that the client went away."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def wait_newer(
    rt: JobRuntime, after: int, wait_s: float, receive: Receive | None = None
) -> VersionView | None:
    """The current view once its version is above `after`, or None after `wait_s` seconds.

    With `receive` (the request's ASGI receive), a client that disconnects ends the wait with
    ClientGone, so a dead worker's heartbeat stops when it dies, not when its poll would have ended.
    """
    deadline = time.monotonic() + wait_s
    gone: asyncio.Future[Any] | None = None
    try:
        while rt.view is None or rt.version <= after:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if receive is None:
                try:
                    async with asyncio.timeout(remaining):  # no extra task per waiter, unlike wait_for
                        await rt.changed.wait()
                except TimeoutError:
                    return None
                continue
            if gone is None:
                gone = asyncio.ensure_future(until_disconnect(receive))
            changed: asyncio.Future[Any] = asyncio.ensure_future(rt.changed.wait())
            done, _ = await asyncio.wait({gone, changed}, timeout=remaining, return_when=FIRST_COMPLETED)
            changed.cancel()
            if gone in done:
                raise ClientGone
    finally:
        if gone is not None:
            gone.cancel()
    return rt.view


@router.get(
    "/{job_id}/schedule",
    responses={
        200: {"model": ScheduleEnvelope | WorkerView, "description": "The schedule (or one worker's view)."},
        304: {"description": "No version newer than after_version / If-None-Match within `wait`."},
    },
)
async def get_schedule(
    request: Request,
    job_id: str,
    service: ServiceDep,
    principal: ReaderDep,
    worker: Annotated[
        str | None, Query(description="d,s: this worker's view; a heartbeat with the job's worker token")
    ] = None,
    after_version: Annotated[int, Query(ge=0, description="Wait for a version newer than this")] = 0,
    wait: Annotated[float, Query(ge=0, description="Seconds to wait (capped by the service)")] = 0.0,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """The current schedule version, at once if newer than after_version, else after up to `wait` s."""
    rt = service.get(job_id)
    w = None if worker is None else parse_worker(worker, rt)
    after = max(after_version, etag_version(if_none_match))
    beat = principal.token_job == job_id
    body, etag = await long_poll(service, rt, w, after, wait, request.receive, heartbeat=beat)
    if body is None:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(body, media_type="application/json", headers={"ETag": etag})


async def long_poll(
    service: JobService,
    rt: JobRuntime,
    w: tuple[int, int] | None,
    after: int,
    wait: float,
    receive: Receive | None = None,
    heartbeat: bool = False,
) -> tuple[bytes | None, str]:
    """The poll itself: (body, ETag), body None for a 304 (also when the client disconnected while
    waiting: nobody reads that answer).

    It is a heartbeat of `w` only when `heartbeat` is true: the poll was authenticated with the job's
    own worker token. A controller-token poll (a person trying the endpoint with curl) must not
    start heartbeat tracking, or the worker it named would be declared failed a timeout later.

    Shared by the route above and by api/fastpoll.py, which answers well-formed polls without
    FastAPI's routing and dependency injection.
    """
    wait_s = min(wait, service.settings.max_wait_s)
    beat = w if heartbeat else None
    if beat is not None:
        rt.last_seen[beat] = time.monotonic()
        rt.polling[beat] = rt.polling.get(beat, 0) + 1
    service.metrics.pollers.inc(1)
    try:
        view = await wait_newer(rt, after, wait_s, receive)
    except ClientGone:
        view = None
    finally:
        service.metrics.pollers.inc(-1)
        if beat is not None:
            rt.polling[beat] -= 1
            rt.last_seen[beat] = time.monotonic()
    if view is None:
        return None, f'"{rt.version}"'
    return (view.full() if w is None else view.for_worker(w)), f'"{view.version}"'
