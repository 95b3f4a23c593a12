"""JobService logic without processes: greedy-then-CP-SAT versions, stale refinements, heartbeats."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from api.background import silent_workers
from api.jobs import JobService
from api.metrics import Metrics
from api.models import EventIn, JobCreate
from api.settings import Settings
from api.solver import SolveOutput, solve
from api.store import SQLiteStore
from planner.contract import FailureScenario
from planner.normalize import normalize
from tests.jobs import service_job

pytestmark = pytest.mark.timeout(60)

JOB = service_job(3, 2, 2)


class FakeSolver:
    """Greedy solves in-process; background (CP-SAT) answers are released by the test."""

    events = "events"

    def __init__(self) -> None:
        self.pending: list[tuple[tuple[Any, ...], asyncio.Future[SolveOutput]]] = []

    async def run(self, pool: object, *args: Any) -> SolveOutput:
        return solve(*args)

    def submit_background(self, priority: int, *args: Any) -> asyncio.Future[SolveOutput]:
        fut: asyncio.Future[SolveOutput] = asyncio.get_running_loop().create_future()
        self.pending.append((args, fut))
        return fut

    def release(self, index: int, speedup: float) -> None:
        """Answer a background solve with the greedy plan, claimed `speedup` times faster."""
        args, fut = self.pending[index]
        out = solve(args[0], args[1], args[2], False)
        doc = json.loads(out.physical_json)
        doc["iteration_time_ms"] = out.iteration_time_ms / speedup
        out.physical_json, out.iteration_time_ms, out.source = (
            json.dumps(doc),
            doc["iteration_time_ms"],
            "cpsat",
        )
        fut.set_result(out)


def make_service(tmp_path: Path) -> tuple[JobService, FakeSolver]:
    fake = FakeSolver()
    settings = Settings(data_dir=tmp_path, insecure_dev=True)
    return JobService(settings, SQLiteStore(tmp_path), fake, Metrics()), fake  # type: ignore[arg-type]


def test_greedy_version_then_better_cpsat_version(tmp_path: Path) -> None:
    async def scenario() -> None:
        service, fake = make_service(tmp_path)
        rt, _ = await service.create(JobCreate(job=JOB))
        assert rt.version == 1 and rt.view is not None and rt.view.source == "greedy"
        greedy_ms = rt.view.schedule["iteration_time_ms"]
        await asyncio.sleep(0.01)  # the refinement task submits its solve
        fake.release(0, speedup=2.0)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if rt.version == 2:
                break
        assert rt.version == 2 and rt.view.source == "cpsat"
        assert rt.view.schedule["iteration_time_ms"] == pytest.approx(greedy_ms / 2)
        plan = service.store.get_plan(normalize(JOB, FailureScenario()).key)
        assert plan is not None and plan.source == "refined"  # the next event on this key uses it
        assert plan.iteration_time_ms == pytest.approx(greedy_ms / 2)
        await service.stop()

    asyncio.run(scenario())


def test_stale_refinement_is_not_published(tmp_path: Path) -> None:
    async def scenario() -> None:
        service, fake = make_service(tmp_path)
        rt, _ = await service.create(JobCreate(job=JOB))
        await service.apply_event(rt.record.id, EventIn(event_id="e1", kind="fail", workers=[(0, 1)]))
        assert rt.version == 2
        await asyncio.sleep(0.01)
        assert len(fake.pending) == 2  # one refinement per scenario
        fake.release(0, speedup=2.0)  # the refinement of the failure-free scenario: stale now
        await asyncio.sleep(0.1)
        assert rt.version == 2 and rt.view is not None and rt.view.source == "greedy"
        fake.release(1, speedup=1.0)  # not better: no new version either
        await asyncio.sleep(0.1)
        assert rt.version == 2
        await service.stop()

    asyncio.run(scenario())


def test_silent_workers(tmp_path: Path) -> None:
    async def scenario() -> None:
        service, _ = make_service(tmp_path)
        rt, _ = await service.create(JobCreate(job=JOB, heartbeat_timeout_s=5))
        now = time.monotonic()
        rt.last_seen = {(0, 0): now - 10, (1, 0): now - 1, (2, 1): now - 10}
        rt.polling = {(2, 1): 1}  # in a long-poll right now: alive
        assert silent_workers(rt, now, 30.0) == [(0, 0)]
        rt.record.heartbeat_enabled = False
        assert silent_workers(rt, now, 30.0) == []
        await service.stop()

    asyncio.run(scenario())
