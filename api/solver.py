"""Solving off the request path: planner calls in process pools, plus canonical-plan mapping.

Three pools keep the kinds of work from starving each other: `events` (greedy plans an event is
waiting for), `whatif` (POST /v1/plan) and `background` (CP-SAT refinement after a cache miss, then
precomputation, in that priority order). Work runs in spawned processes, so CP-SAT never holds the
event loop or the GIL of the server process.

Precomputed plans are stored per normalized scenario key as the *canonical* schedule (pipelines
numbered as normalize() numbers them); from_canonical() maps one onto any physical scenario with the
same key. That is a relabelling of pipelines, which keeps validity and iteration time unchanged.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pydantic_core

from api.errors import SolverBusyError
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import InvalidInputError, PlannerError, ScheduleRuleError, UnrecoverableScenarioError
from planner.normalize import Normalized, normalize, to_physical
from planner.processes import exit_with_parent

log = logging.getLogger(__name__)


@dataclass
class SolveOutput:
    """What a pool process sends back (plain data, cheap to pickle)."""

    key: str
    canonical_json: str
    physical_json: str
    iteration_time_ms: float
    source: str
    figures: dict[str, Any] = field(default_factory=dict)
    error: tuple[str, str, list[int]] | None = None  # (kind, message, stages)


def to_canonical(schedule: Schedule, norm: Normalized) -> Schedule:
    """Inverse of planner.normalize.to_physical: relabel a physical schedule's pipelines canonically."""
    inverse = [0] * len(norm.to_physical)
    for c, d in enumerate(norm.to_physical):
        inverse[d] = c
    back = Normalized(key=norm.key, scenario=norm.scenario, to_physical=tuple(inverse))
    return to_physical(schedule, back, norm.scenario)


def from_canonical(canonical_json: str, job: JobSpec, scenario: FailureScenario) -> Schedule:
    """The stored canonical schedule of scenario's key, mapped onto scenario's physical workers."""
    norm = normalize(job, scenario)
    return to_physical(Schedule.model_validate_json(canonical_json), norm, scenario)


def relabel_canonical(canonical_json: str, norm: Normalized, scenario: FailureScenario) -> dict[str, Any]:
    """from_canonical() on plain JSON data: the same document, without pydantic models.

    The event path's hot step (a stored plan was validated when it was made): building Schedule
    models of a whole schedule costs ~10x more than relabelling its dicts. Workers are sorted by
    (stage, pipeline) like to_physical(); `failed` and `slow` become the physical scenario's.
    """
    perm = norm.to_physical
    doc: dict[str, Any] = pydantic_core.from_json(canonical_json)  # ~2x faster than json.loads
    for ws in doc["workers"]:
        ws["worker"] = [perm[ws["worker"][0]], ws["worker"][1]]
        for a in ws["actions"]:
            mb = a.get("mb")
            if mb is not None:
                a["mb"] = [perm[mb[0]], mb[1]]
    doc["workers"].sort(key=lambda ws: (ws["worker"][1], ws["worker"][0]))
    doc["failed"] = [[int(d), int(s)] for d, s in scenario.failed]
    if scenario.slow:
        doc["slow"] = [sw.model_dump(mode="json", exclude_none=True) for sw in scenario.slow]
    else:
        doc.pop("slow", None)
    return doc


def solve(
    job_json: str,
    scenario_json: str,
    time_limit_s: float,
    use_cpsat: bool,
    repartition: bool = False,
    partition_json: str | None = None,
) -> SolveOutput:
    """Pool entry point: plan one scenario. Planner errors come back in `.error` (they do not pickle).

    `repartition`: the job plans with re-partition (api/solve_partition.py: the partition chosen with
    the schedule, or `partition_json`'s refined); the plan's key is then the re-partition key."""
    from planner.plan import plan

    job = JobSpec.model_validate_json(job_json)
    scenario = FailureScenario.model_validate_json(scenario_json)
    limit = timedelta(seconds=time_limit_s)
    extra_figures: dict[str, Any] | None = None
    try:
        if repartition:
            from api.solve_partition import plan_for_service

            result, extra_figures = plan_for_service(job, scenario, limit, use_cpsat, partition_json)
        else:
            result = plan(job, scenario, time_limit=limit, use_cpsat=use_cpsat)
    except UnrecoverableScenarioError as exc:
        return SolveOutput("", "", "", 0.0, "", error=("unrecoverable", str(exc), exc.stages))
    except PlannerError as exc:
        kind = "rule" if isinstance(exc, ScheduleRuleError) else "invalid"
        return SolveOutput("", "", "", 0.0, "", error=(kind, str(exc), []))
    except (MemoryError, OSError) as exc:  # out of resources, not a wrong input: the caller may retry
        return SolveOutput("", "", "", 0.0, "", error=("busy", f"{type(exc).__name__}: {exc}", []))
    except Exception as exc:  # a planner bug: report it as such instead of a broken pool
        log.exception("planner failed")
        return SolveOutput("", "", "", 0.0, "", error=("internal", f"{type(exc).__name__}: {exc}", []))
    try:
        norm = normalize(job, scenario)
        canonical = to_canonical(result.schedule, norm)
        try:
            figures = result.figures()
        except ArithmeticError:  # e.g. a job whose every duration is 0 has a zero lower bound
            itime = result.iteration_time_ms
            figures = {"job": job.name, "iteration_time_ms": itime, "source": result.source}
        key = result.key
        if extra_figures is not None:
            from api.solve_partition import plan_key

            figures["repartition"] = extra_figures
            key = plan_key(norm.key, True)  # (result.key is the derived job's)
        return SolveOutput(
            key=key,
            canonical_json=canonical.model_dump_json(exclude_none=True),
            physical_json=result.schedule.model_dump_json(exclude_none=True),
            iteration_time_ms=result.iteration_time_ms,
            source=result.source,
            figures=figures,
        )
    except Exception as exc:  # anything raised here would otherwise surface as a bare 500
        log.exception("planner output failed")
        return SolveOutput("", "", "", 0.0, "", error=("internal", f"{type(exc).__name__}: {exc}", []))


def raise_error(out: SolveOutput) -> None:
    """Re-raise a planner error a pool process reported."""
    if out.error is None:
        return
    kind, message, stages = out.error
    if kind == "unrecoverable":
        raise UnrecoverableScenarioError(stages)
    if kind == "busy":
        raise SolverBusyError(f"the solver ran out of resources ({message}); retry later")
    if kind in ("rule", "internal"):
        raise ScheduleRuleError("planner", message)
    raise InvalidInputError(message)


def enumerate_scenarios(job: JobSpec, max_failures: int, limit: int) -> list[FailureScenario]:
    """Canonical recoverable scenarios with 0..max_failures failed workers, one per key, fewest first.

    Any set of k failures touches at most k pipelines and, up to a relabelling, pipelines 0..k-1,
    so only workers of those pipelines are combined. Stops after `limit` distinct keys.
    """
    seen: set[str] = set()
    out: list[FailureScenario] = []
    for k in range(max_failures + 1):
        grid = [(d, s) for d in range(min(k, job.num_pipelines)) for s in range(job.num_stages)]
        for combo in itertools.combinations(grid, k):
            scenario = FailureScenario(failed=list(combo))
            try:
                scenario.check_against(job)
            except UnrecoverableScenarioError:
                continue
            norm = normalize(job, scenario)
            if norm.key in seen:
                continue
            seen.add(norm.key)
            out.append(norm.scenario)
            if len(out) >= limit:
                return out
    return out


def _noop() -> int:
    return 0


class QuietPool(ProcessPoolExecutor):
    """A process pool whose processes ignore Ctrl+C: SIGINT is blocked while they are spawned.

    Ctrl+C in a terminal (and `kill -INT -PGID`) signals the whole process group. Pool processes
    that took it printed a KeyboardInterrupt traceback each (while idle in the call queue or still
    importing) before the service had even begun its graceful shutdown, which ends them itself.
    A blocked signal mask is inherited across fork and exec, from the thread that spawns (the one
    calling submit), so it covers the processes' start-up too; the caller's own mask is restored
    at once, and a SIGINT that came meanwhile is delivered to it then.
    """

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return super().submit(fn, *args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


WHATIF_IN_FLIGHT = 2  # what-if solves running or queued at once (the pool has one process)


class Solver:
    """The process pools and the background priority queue."""

    def __init__(self, events_processes: int, background_processes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        kw: dict[str, Any] = {"mp_context": ctx, "initializer": exit_with_parent, "initargs": (os.getpid(),)}
        self._pool_kw = kw
        self.events: Executor = QuietPool(events_processes, **kw)
        self.whatif: Executor = QuietPool(1, **kw)
        self.background: Executor = QuietPool(background_processes, **kw)
        self._num_background = background_processes
        self._queue: asyncio.PriorityQueue[tuple[int, int, tuple[Any, ...], asyncio.Future[Any]]] = (
            asyncio.PriorityQueue()
        )
        self._seq = itertools.count()
        self._consumers: list[asyncio.Task[None]] = []
        self.ray: Any = None  # api.solver_ray.RayBackground when RECYCLE_RAY_ADDRESS is set
        self._whatif_in_flight = 0  # what-if solves submitted and not ended (run_whatif)

    def start(self) -> None:
        """Start the background consumers and warm the pools (spawn start-up is paid now, not later).

        With RECYCLE_RAY_ADDRESS set, background solves run on that Ray cluster (api/solver_ray.py),
        one consumer per CPU of the cluster; InvalidInputError (one line) when it cannot connect.
        """
        from planner.settings import planner_settings

        address = planner_settings().ray_address
        if address:
            from api.solver_ray import RayBackground

            self.ray = RayBackground(address)
            self.ray.start()
        for index in range(self.background_slots):
            self._consumers.append(asyncio.create_task(self._consume(index)))
        for pool in (self.events, self.whatif, self.background):
            pool.submit(_noop)

    @property
    def background_slots(self) -> int:
        """How many background solves run at once: the Ray cluster's CPUs, or the local pool's size."""
        if self.ray is not None and self.ray.alive:
            return max(self._num_background, self.ray.cpus)
        return self._num_background

    async def run_whatif(self, *args: Any) -> SolveOutput:
        """solve(*args) in the what-if pool, or SolverBusyError (503, retry) at once when
        WHATIF_IN_FLIGHT solves are running or queued there. A request that times out leaves its solve
        running (a process cannot be interrupted; a queued one is cancelled): without the cap, clients
        retrying after their 503 queued more work behind it and every later what-if timed out too."""
        if self._whatif_in_flight >= WHATIF_IN_FLIGHT:
            raise SolverBusyError(
                f"the what-if solver is busy ({self._whatif_in_flight} solves in flight): retry in a few s"
            )
        self._whatif_in_flight += 1
        loop = asyncio.get_running_loop()

        def finished(_: Any) -> None:
            loop.call_soon_threadsafe(self._whatif_finished)

        return await self.run(self.whatif, *args, on_done=finished)

    def _whatif_finished(self) -> None:
        self._whatif_in_flight -= 1

    async def run(
        self, pool: Executor, *args: Any, on_done: Callable[[Any], None] | None = None
    ) -> SolveOutput:
        """solve(*args) in `pool`, awaited without blocking the event loop; `on_done` is called (in a
        pool thread) when the solve itself ends, even after this await was cancelled, or when it could
        not be submitted.

        A pool whose process died (killed, out of memory) is broken for good: it is replaced by a
        fresh one and SolverBusyError (503, retry) is raised instead of a bare 500 for this and
        every later request.
        """
        try:
            try:
                cf = pool.submit(solve, *args)
            except BaseException:
                if on_done is not None:
                    on_done(None)
                raise
            if on_done is not None:
                cf.add_done_callback(on_done)
            out: SolveOutput = await asyncio.wrap_future(cf)
        except BrokenProcessPool as exc:
            name = self._replace(pool)
            raise SolverBusyError(f"a solver process ({name} pool) died; it was restarted: retry") from exc
        except OSError as exc:  # e.g. no process could be started (EAGAIN, EMFILE) under load
            if getattr(pool, "_broken", False):
                self._replace(pool)
            raise SolverBusyError(f"no solver process could run this ({exc}); retry later") from exc
        return out

    def _replace(self, broken: Executor) -> str:
        """Swap a broken pool for a new one of the same size; returns the pool's name."""
        for name in ("events", "whatif", "background"):
            if getattr(self, name) is broken:
                size = getattr(broken, "_max_workers", 1)
                fresh = QuietPool(size, **self._pool_kw)
                setattr(self, name, fresh)
                broken.shutdown(wait=False, cancel_futures=True)
                log.error("solver: the %s pool broke (a process died); replaced it", name)
                return name
        return "unknown"  # already replaced by a concurrent failure

    def submit_background(self, priority: int, *args: Any) -> asyncio.Future[SolveOutput]:
        """Queue solve(*args) for the background pool; lower priority numbers run first."""
        fut: asyncio.Future[SolveOutput] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((priority, next(self._seq), args, fut))
        return fut

    async def _consume(self, index: int = 0) -> None:
        while index < self.background_slots:  # consumers beyond the local pool's end when Ray is lost
            _, _, args, fut = await self._queue.get()
            if fut.cancelled():
                continue
            try:
                out = None if self.ray is None else await self.ray.solve(*args)
                if out is None:  # no Ray, or Ray lost: the local pool
                    out = await self.run(self.background, *args)
            except asyncio.CancelledError:
                fut.cancel()
                raise
            except Exception as exc:  # a crashed pool process must not kill the consumer
                log.exception("background solve failed")
                if not fut.done():
                    fut.set_exception(exc)
                continue
            if not fut.done():
                fut.set_result(out)

    def shutdown(self) -> None:
        """Stop consumers and pools; running solves in pool processes are terminated.

        Waits (a few seconds at most) for the pools' manager threads: one still closing its wake-up
        pipe while the interpreter exits made concurrent.futures' exit hook write to a closed pipe
        (an "OSError: Bad file descriptor" traceback on a quick stop).
        """
        for task in self._consumers:
            task.cancel()
        if self.ray is not None:
            self.ray.close()  # the driver disconnects from Ray (ray.shutdown) and ends
        managers = []
        for pool in (self.events, self.whatif, self.background):
            procs = list(getattr(pool, "_processes", {}).values())
            managers.append(getattr(pool, "_executor_manager_thread", None))
            pool.shutdown(wait=False, cancel_futures=True)
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for thread in managers:
            if thread is not None:
                thread.join(timeout=5)
