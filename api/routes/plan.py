"""/v1/plan: a stateless what-if (job spec + scenario in, schedule + figures out)."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter

from api.deps import ControllerDep, ServiceDep
from api.errors import SolverBusyError
from api.models import PlanRequest, PlanResponse
from api.rules import check_dimensions
from api.solve_partition import REPARTITION_PLANS, check_repartition
from api.solver import raise_error
from planner.contract_fields import unread_fields

router = APIRouter(prefix="/v1", tags=["plan"])

GRACE_S = 10.0  # greedy, validation and process start-up on top of the CP-SAT limit


@router.post("/plan", response_model=PlanResponse, responses={409: {"description": "Unrecoverable scenario"}})
async def what_if(body: PlanRequest, service: ServiceDep, _: ControllerDep) -> PlanResponse:
    """Plan one scenario in the what-if pool with a time limit capped by the settings."""
    settings = service.settings
    check_dimensions(body.job, settings)
    body.scenario.check_against(body.job)
    if body.repartition:
        check_repartition(body.job)
    limit = settings.cap_time_limit(body.time_limit_s, settings.plan_time_limit_s).total_seconds()
    plans = REPARTITION_PLANS if body.repartition else 1  # plan_repartition plans up to this many
    mode = (True,) if body.repartition else ()
    t0 = time.perf_counter()
    try:
        out = await asyncio.wait_for(
            service.solver.run_whatif(
                body.job.model_dump_json(),
                body.scenario.model_dump_json(),
                limit,
                body.use_cpsat,
                *mode,
            ),
            limit * plans + GRACE_S,
        )
    except TimeoutError:
        waited = limit * plans + GRACE_S
        raise SolverBusyError(f"what-if solve did not finish within {waited:.0f} s") from None
    service.metrics.solve_seconds.labels(purpose="whatif").observe(time.perf_counter() - t0)
    service.metrics.solves.labels(purpose="whatif", source=out.source or "error").inc()
    raise_error(out)
    warnings = unread_fields(body.job, "job.") + unread_fields(body.scenario, "scenario.")
    return PlanResponse(schedule=json.loads(out.physical_json), figures=out.figures, warnings=warnings)
