"""/v1/jobs/{id}/schedule: the long-poll workers use. A poll with `worker` and the job's worker token is
that worker's heartbeat (its arrival is: a poll left parked is no sign of life) and waits at most a
third of the heartbeat timeout; a controller-token poll never is a heartbeat."""

from __future__ import annotations

import asyncio
import functools
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from starlette.types import Receive

from api.deps import ReaderDep, ServiceDep
from api.jobs import JobRuntime, JobService
from api.models import ScheduleEnvelope, WorkerView
from api.views import VersionView
from planner.errors import InvalidInputError

router = APIRouter(prefix="/v1/jobs", tags=["schedule"])

# The longest wait (seconds) the service grants this poll; a worker should ask for no more.
WAIT_HEADER = "Recycle-Poll-Wait-Max"


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


def etag_version(if_none_match: str | None, current: int) -> int:
    """The version an If-None-Match header names ("7", W/"7"; "*", any version: the `current` one),
    0 when none or not a version."""
    if not if_none_match:
        return 0
    if if_none_match.strip() == "*":
        return current
    text = if_none_match.strip().removeprefix("W/").strip('"')
    return int(text) if text.isdigit() else 0


class ClientGone(Exception):
    """The poller closed its connection while waiting (a killed worker's socket is closed by its kernel)."""


async def until_disconnect(receive: Receive) -> None:
    """Return once the ASGI server reports that the client went away."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def wait_newer(
    rt: JobRuntime,
    after: int,
    wait_s: float,
    receive: Receive | None = None,
    cap: Callable[[], float] | None = None,
) -> VersionView | None:
    """The current view once its version is above `after`, or None after `wait_s` seconds (at once
    when the service shuts down: JobService.begin_stop).

    With `receive` (the request's ASGI receive), a client that disconnects ends the wait with
    ClientGone (nobody would read the answer). `cap()`, read again on every wake-up, bounds the wait
    further: the job's heartbeat switches can change while the poll is parked.
    """
    start = time.monotonic()
    gone: asyncio.Future[Any] | None = None
    try:
        while (rt.view is None or rt.version <= after) and not rt.closing:
            limit = wait_s if cap is None else min(wait_s, cap())
            remaining = start + limit - time.monotonic()
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
    return None if rt.view is None or rt.version <= after else rt.view


_WAIT_DOC = {
    WAIT_HEADER: {
        "description": "The longest wait (seconds) this poll was granted: RECYCLE_MAX_WAIT_S, and a third "
        "of the heartbeat timeout for a worker's heartbeat poll. A worker should ask for no more.",
        "schema": {"type": "string"},
    }
}


@router.get(
    "/{job_id}/schedule",
    responses={
        200: {
            "model": ScheduleEnvelope | WorkerView,
            "description": "The schedule (or one worker's view).",
            "headers": _WAIT_DOC,
        },
        304: {
            "description": "No version newer than after_version / If-None-Match within `wait`.",
            "headers": _WAIT_DOC,
        },
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
    wait: Annotated[
        float, Query(ge=0, allow_inf_nan=False, description="Seconds to wait (capped by the service)")
    ] = 0.0,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """The current schedule version, at once if newer than after_version, else after up to `wait` s."""
    rt = service.get(job_id)
    w = None if worker is None else parse_worker(worker, rt)
    after = max(after_version, etag_version(if_none_match, rt.version))
    beat = principal.token_job == job_id
    body, etag, most = await long_poll(service, rt, w, after, wait, request.receive, heartbeat=beat)
    headers = {"ETag": etag, WAIT_HEADER: most}
    if body is None:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type="application/json", headers=headers)


async def long_poll(
    service: JobService,
    rt: JobRuntime,
    w: tuple[int, int] | None,
    after: int,
    wait: float,
    receive: Receive | None = None,
    heartbeat: bool = False,
) -> tuple[bytes | None, str, str]:
    """The poll itself: (body, ETag, the Recycle-Poll-Wait-Max value), body None for a 304 (also
    when the client disconnected while waiting: nobody reads that answer).

    It is a heartbeat of `w` only when `heartbeat` is true: the poll was authenticated with the job's
    own worker token. A controller-token poll (a person trying the endpoint with curl) must not
    start heartbeat tracking, or the worker it named would be declared failed a timeout later. A
    heartbeat counts when the request arrives, never while it is parked or when it is answered (a
    partitioned worker's open socket takes the answer as well), so its wait is capped at a third of
    the heartbeat timeout (JobService.poll_wait_cap): a healthy worker's next poll arrives in time.
    A worker that reported `done` is no longer tracked; its polls are plain reads.

    Shared by the route above and by api/fastpoll.py, which answers well-formed polls without
    FastAPI's routing and dependency injection.
    """
    wait_s = min(wait, service.settings.max_wait_s)
    cap: Callable[[], float] | None = None
    if heartbeat and w is not None and w not in rt.done:
        rt.last_seen[w] = time.monotonic()
        cap = functools.partial(service.poll_wait_cap, rt)
        most = cap()
    else:
        most = service.settings.max_wait_s
    service.metrics.pollers.inc()
    try:
        view = await wait_newer(rt, after, wait_s, receive, cap)
    except ClientGone:
        view = None
    finally:
        service.metrics.pollers.dec()
    if view is None:
        return None, f'"{rt.version}"', f"{most:g}"
    return (view.full() if w is None else view.for_worker(w)), f'"{view.version}"', f"{most:g}"
