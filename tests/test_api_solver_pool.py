"""A solver process that dies answers 503 (SolverBusyError), and the pool is replaced, not left broken."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from api.errors import SolverBusyError
from api.solver import Solver, raise_error, solve
from planner.contract import FailureScenario
from tests.test_api_service import JOB

pytestmark = pytest.mark.timeout(120)


def test_killed_pool_process_gives_503_then_a_fresh_pool_serves() -> None:
    async def scenario() -> None:
        solver = Solver(1, 1)
        solver.start()
        try:
            args = (JOB.model_dump_json(), FailureScenario().model_dump_json(), 1.0, False)
            out = await solver.run(solver.whatif, *args)
            assert out.error is None and out.iteration_time_ms > 0
            broken = solver.whatif
            for proc in list(getattr(broken, "_processes", {}).values()):
                os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(SolverBusyError, match="restarted"):
                await solver.run(solver.whatif, *args)
            assert solver.whatif is not broken
            again = await solver.run(solver.whatif, *args)
            assert again.error is None and again.iteration_time_ms == pytest.approx(out.iteration_time_ms)
        finally:
            solver.shutdown()

    asyncio.run(scenario())


def test_out_of_resources_in_the_planner_is_busy_not_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.plan

    def boom(*args: object, **kwargs: object) -> None:
        raise MemoryError("no room")

    monkeypatch.setattr(planner.plan, "plan", boom)
    out = solve(JOB.model_dump_json(), FailureScenario().model_dump_json(), 1.0, False)
    assert out.error is not None and out.error[0] == "busy"
    with pytest.raises(SolverBusyError, match="no room"):
        raise_error(out)


def test_whatif_solves_in_flight_are_capped_and_a_timed_out_one_frees_its_slot_when_it_ends() -> None:
    """Before: a what-if whose request timed out kept running and every later one queued behind it,
    so clients retrying after their 503 made the backlog (and the 503s) grow."""
    from pathlib import Path

    from api.solver import WHATIF_IN_FLIGHT
    from planner.contract import JobSpec

    slow_job = Path(__file__).parents[1] / "examples" / "gpt3-13b-p8d8-mem1x.json"
    slow = (
        JobSpec.model_validate_json(slow_job.read_text()).model_dump_json(),
        FailureScenario(failed=[(1, 4)]).model_dump_json(),
        1.0,
        True,
    )
    quick = (JOB.model_dump_json(), FailureScenario().model_dump_json(), 1.0, False)

    async def scenario() -> None:
        solver = Solver(1, 1)
        solver.start()
        try:
            requests = [asyncio.create_task(solver.run_whatif(*slow)) for _ in range(WHATIF_IN_FLIGHT)]
            await asyncio.sleep(0.2)
            with pytest.raises(SolverBusyError, match="busy"):
                await solver.run_whatif(*quick)
            for request in requests:  # the requests time out; their solves run on
                request.cancel()
            await asyncio.gather(*requests, return_exceptions=True)
            assert solver._whatif_in_flight >= 1  # the running one holds its slot (a queued one is cancelled)
            for _ in range(1200):  # the slots come back as the solves end
                if solver._whatif_in_flight == 0:
                    break
                await asyncio.sleep(0.1)
            out = await solver.run_whatif(*quick)
            assert out.error is None and out.iteration_time_ms > 0
        finally:
            solver.shutdown()

    asyncio.run(scenario())
