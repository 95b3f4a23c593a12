"""/healthz (the process answers), /readyz (store loaded, pools up), /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from api.deps import ServiceDep
from api.metrics import CONTENT_TYPE

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the event loop answers."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """Readiness: jobs are loaded from the store and the solver pools are started."""
    if getattr(request.app.state, "ready", False):
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "starting"}, status_code=503)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(service: ServiceDep) -> Response:
    """Request latency, solves, cache hits, versions, connected pollers (Prometheus text format)."""
    return Response(service.metrics.render(), media_type=CONTENT_TYPE)
