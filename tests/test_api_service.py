"""JobService logic without processes: greedy-then-CP-SAT versions, stale refinements, heartbeats."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from api.background import scan_heartbeats, silent_workers
from api.errors import JobFinishedError, WorkerFailedError
from api.jobs import JobService
from api.metrics import Metrics
from api.models import EventIn, JobCreate
from api.routes.schedule import long_poll
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
        rt.last_seen = {(0, 0): now - 10, (1, 0): now - 1, (2, 1): now - 10, (1, 1): now - 3}
        rt.done = {(2, 1)}  # completed its iterations: its silence is no failure
        assert silent_workers(rt, now, 30.0) == [(0, 0)]
        silent, deadline = scan_heartbeats(rt, now, 30.0)
        assert silent == [(0, 0)] and deadline == pytest.approx(now - 3 + 5)  # [1, 1] is next
        rt.record.heartbeat_enabled = False
        assert scan_heartbeats(rt, now, 30.0) == ([], None)
        await service.stop()

    asyncio.run(scenario())


def test_after_a_restore_the_first_poll_starts_the_others_clocks(tmp_path: Path) -> None:
    """Before: a restart that came back after the restore grace was failed worker by worker: the
    first poll ended the wait and every peer not yet polled was already a timeout past the grace."""

    async def scenario() -> None:
        service, _ = make_service(tmp_path)
        rt, _ = await service.create(JobCreate(job=JOB, heartbeat_timeout_s=5))
        now = time.monotonic()
        rt.expect_every_worker(now - 60)  # the grace ended a minute ago
        assert scan_heartbeats(rt, now, 30.0) == ([], None)  # nobody back: the job waits
        rt.last_seen[(0, 0)] = now - 1  # the first worker back
        silent, deadline = scan_heartbeats(rt, now, 30.0)
        assert silent == [] and deadline == pytest.approx(now - 1 + 5)
        assert rt.last_seen[(1, 1)] == now - 1 and rt.restore_until is None
        assert scan_heartbeats(rt, now + 3.5, 30.0)[0] == []  # the peers have a timeout to poll
        rt.last_seen[(0, 0)] = now + 4
        assert (1, 1) in scan_heartbeats(rt, now + 4.5, 30.0)[0]  # a timeout after the first poll
        rt.expect_every_worker(now + 60)  # back within the grace: the clocks start at its end
        rt.last_seen[(0, 0)] = now
        scan_heartbeats(rt, now, 30.0)
        assert rt.last_seen[(1, 1)] == now + 60
        await service.stop()

    asyncio.run(scenario())


def test_a_parked_poll_is_no_sign_of_life(tmp_path: Path) -> None:
    """Liveness comes from polls arriving: a worker whose poll stays parked (a partitioned worker's
    socket stays open) is silent from the poll's arrival, and its poll waits at most a third of
    the heartbeat timeout."""

    async def scenario() -> None:
        service, _ = make_service(tmp_path)
        rt, _ = await service.create(JobCreate(job=JOB, heartbeat_timeout_s=0.3))
        assert service.poll_wait_cap(rt) == pytest.approx(0.1)
        t0 = time.monotonic()
        body, _, most = await long_poll(service, rt, (1, 1), rt.version, 30.0, heartbeat=True)
        assert body is None and 0.09 <= time.monotonic() - t0 < 1.0 and float(most) == pytest.approx(0.1)
        arrival = rt.last_seen[(1, 1)]
        assert arrival <= t0 + 0.05  # the arrival, not the end of the poll
        rt.record.heartbeat_enabled = False  # no cap now: the next poll stays parked (heartbeats off)
        poll = asyncio.create_task(long_poll(service, rt, (1, 1), rt.version, 30.0, heartbeat=True))
        await asyncio.sleep(0.05)
        arrival = rt.last_seen[(1, 1)]
        rt.record.heartbeat_enabled = True  # switched on behind the service's back: no PATCH, no wake-up
        await asyncio.sleep(0.35)
        assert not poll.done() and rt.last_seen[(1, 1)] == arrival
        assert silent_workers(rt, time.monotonic(), 30.0) == [(1, 1)]  # parked, yet silent
        service.set_switches(rt, True, 0.3)  # a PATCH restarts tracking and ends the parked poll
        assert rt.last_seen[(1, 1)] > arrival
        assert (await asyncio.wait_for(poll, 1.0))[0] is None
        await service.stop()

    asyncio.run(scenario())


def test_done_workers_finish_the_job(tmp_path: Path) -> None:
    """`done` events: no version until every alive worker is done, then one version with the same
    schedule and state finished; then every event but a done of done workers is refused. A failed
    worker's done is refused; the done set survives a reload from the store."""

    async def scenario() -> None:
        service, _ = make_service(tmp_path)
        rt, _ = await service.create(JobCreate(job=JOB, heartbeat_timeout_s=5))
        job_id = rt.record.id
        await service.apply_event(job_id, EventIn(event_id="f", kind="fail", workers=[(2, 1)]))
        assert rt.version == 2 and rt.view is not None
        schedule = rt.view.schedule
        with pytest.raises(WorkerFailedError):
            await service.apply_event(job_id, EventIn(event_id="x", kind="done", workers=[(2, 1)]))
        alive = [(d, s) for d in range(3) for s in range(2) if (d, s) != (2, 1)]
        rt.last_seen = {w: time.monotonic() for w in alive}
        for i, w in enumerate(alive[:-1]):
            done = EventIn(event_id=f"d{i}", kind="done", workers=[w])
            result, lost = await service.apply_event(job_id, done)
            assert lost == [] and result["state"] == "running" and result["version"] == 2
            assert result["changed"] is False and w not in rt.last_seen
        last = EventIn(event_id="last", kind="done", workers=[alive[-1]])
        result, _ = await service.apply_event(job_id, last)
        assert result["state"] == "finished" and result["version"] == 3 and result["changed"] is False
        assert rt.record.state == "finished" and rt.view.state == "finished" and rt.view.schedule == schedule
        assert rt.done == set(alive) and rt.last_seen == {}
        again, _ = await service.apply_event(job_id, last)
        assert again == {**result, "replayed": True}
        other, _ = await service.apply_event(job_id, EventIn(event_id="o", kind="done", workers=alive[:2]))
        assert other["state"] == "finished" and other["version"] == 3 and rt.version == 3
        late = [("fail", (0, 0)), ("rejoin", (2, 1)), ("done", (2, 1))]
        for kind, w in late:
            with pytest.raises(JobFinishedError):
                event = EventIn.model_validate({"event_id": f"late-{kind}", "kind": kind, "workers": [w]})
                await service.apply_event(job_id, event)
        await service.stop()
        service.store.close()
        reloaded, _ = make_service(tmp_path)
        (back,) = reloaded.load()
        assert back.record.state == "finished" and back.done == set(alive) and back.version == 3

    asyncio.run(scenario())


def test_a_fail_drops_the_done_mark_and_can_finish_the_job(tmp_path: Path) -> None:
    async def scenario() -> None:
        service, _ = make_service(tmp_path)
        rt, _ = await service.create(JobCreate(job=JOB))
        job_id = rt.record.id
        others = [(d, s) for d in range(3) for s in range(2) if d != 2]
        await service.apply_event(job_id, EventIn(event_id="d", kind="done", workers=[*others, (2, 0)]))
        assert rt.record.state == "running" and rt.version == 1
        await service.apply_event(job_id, EventIn(event_id="f", kind="fail", workers=[(2, 0), (2, 1)]))
        assert rt.record.state == "finished" and rt.done == set(others) and rt.version == 2
        await service.stop()

    asyncio.run(scenario())
