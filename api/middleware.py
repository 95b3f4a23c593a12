"""Pure ASGI middleware (cheap enough for thousands of long-polls): body size limit and request timing."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.metrics import Metrics


async def _reject(send: Send, limit: int) -> None:
    body = b'{"detail":"request body larger than %d bytes","error":"too_large"}' % limit
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class HeadMiddleware:
    """HEAD on any path is answered as GET is, without the body (RFC 9110 section 9.3.2: a
    general-purpose server supports HEAD wherever it supports GET): the same status and headers
    (ETag, Content-Length), so a probe or a cache check need not fetch a schedule."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class BodyLimitMiddleware:
    """Answer 413 to bodies over `max_bytes`, by Content-Length or by counting a streamed body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _reject(send, self.max_bytes)
                return
        if scope["method"] not in ("POST", "PUT", "PATCH", "DELETE"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:  # buffer the body (it is bounded), so an oversized one is refused before parsing
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _reject(send, self.max_bytes)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def route_label(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The route template a request is counted under: the route that served it, else the route its
    path names (a request answered before routing, a 413 or a NaN 422, or by a plain Starlette route
    such as /openapi.json), else `unmatched` (a path no route serves: no label per stray URL)."""
    route = scope.get("route")
    if route is not None:
        return str(getattr(route, "path", "unmatched"))
    for candidate in routes:
        path = getattr(candidate, "path", None)  # an included router has none: its routes are listed
        if path is not None and candidate.matches(scope)[0] is not Match.NONE:
            return str(path)
    return "unmatched"


class TimingMiddleware:
    """Observe request latency per route template, method and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute] = ()) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status: dict[str, Any] = {"code": 500}

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            self.metrics.request_seconds.labels(
                route=route_label(scope, self.routes), method=scope["method"], status=str(status["code"])
            ).observe(time.perf_counter() - t0)
