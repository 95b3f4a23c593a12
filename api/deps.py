"""FastAPI dependencies: settings, the job service, and who is calling (controller or a job's worker).

401 means no valid credentials at all; 403 means a valid token that may not do this (a worker token
reading or posting events for another job, registering, listing or patching jobs). Tokens are
compared in constant time.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.jobs import JobService
from api.settings import Settings


async def app_settings(request: Request) -> Settings:
    """The settings the app was built with (create_app(settings), else the lru_cached get_settings()).

    Read from app.state rather than through dependency_overrides: FastAPI re-analyses every
    dependency on every request while any override is installed, which costs ~4 ms per poll.
    """
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(app_settings)]

_bearer = HTTPBearer(auto_error=False, description="Controller token, or a job's worker token.")


async def get_service(request: Request) -> JobService:
    """The app's JobService (created in the lifespan)."""
    service: JobService = request.app.state.service
    return service


ServiceDep = Annotated[JobService, Depends(get_service)]


@dataclass(frozen=True)
class Principal:
    """Who is calling: the controller, or the workers of one job."""

    role: Literal["controller", "worker"]
    job_id: str | None = None
    token_job: str | None = None  # the job whose worker token was presented (heartbeats count for it)


def authenticate(token: str | None, settings: Settings, service: JobService) -> Principal:
    """Map a bearer token to a Principal, or raise 401."""
    if settings.controller_token is None and settings.insecure_dev:
        return Principal("controller", token_job=service.job_id_for_token(token) if token else None)
    if token:
        if settings.controller_token is not None and hmac.compare_digest(
            token.encode(), settings.controller_token.get_secret_value().encode()
        ):
            return Principal("controller")
        job_id = service.job_id_for_token(token)
        if job_id is not None:
            return Principal("worker", job_id, token_job=job_id)
    raise HTTPException(401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})


async def get_principal(
    settings: SettingsDep,
    service: ServiceDep,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller, from the Authorization: Bearer header."""
    return authenticate(None if creds is None else creds.credentials, settings, service)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def require_controller(principal: PrincipalDep) -> Principal:
    """Only the controller token may register, list or patch jobs."""
    if principal.role != "controller":
        raise HTTPException(
            403, "this needs the controller token; a worker token may only read its job and post its events"
        )
    return principal


async def require_job_reader(job_id: str, principal: PrincipalDep) -> Principal:
    """The controller, or a worker token of this very job (reads, and events of that job)."""
    if principal.role == "worker" and principal.job_id != job_id:
        raise HTTPException(403, "this worker token belongs to another job")
    return principal


ControllerDep = Annotated[Principal, Depends(require_controller)]
ReaderDep = Annotated[Principal, Depends(require_job_reader)]
