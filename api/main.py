"""The app factory: create_app(settings) wires store, solver pools, job service, routes and middleware."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from api.background import heartbeat_loop, precompute
from api.errors import ServiceError, install_error_handlers
from api.fastpoll import answer_poll
from api.job_sync import ReplicaSync
from api.jobs import JobRuntime, JobService
from api.metrics import Metrics
from api.middleware import BodyLimitMiddleware, HeadMiddleware, TimingMiddleware
from api.routes import events, health, jobs, pages, plan, schedule
from api.settings import Settings, get_settings
from api.solver import Solver
from api.store import Store, open_store
from api.store_coord import Coordinator, LocalCoordinator
from planner.errors import PlannerError

log = logging.getLogger(__name__)


class ServiceApp(FastAPI):
    """FastAPI, with the schedule long-poll served first by api/fastpoll.py (the hot path)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and await answer_poll(self, scope, receive, send):
            return
        await super().__call__(scope, receive, send)


def _coordinator(store: Store) -> Coordinator:
    if store.shared:
        from api.store_pg import PostgresStore
        from api.store_pg_coord import PgCoordinator

        assert isinstance(store, PostgresStore)
        return PgCoordinator(store)
    return LocalCoordinator()


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service. Without `settings`, they come from the environment (RECYCLE_*).

    Raises RuntimeError when there is no controller token and insecure_dev is off.
    """
    settings = settings or get_settings()
    settings.check_startable()
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = open_store(settings)
        coord = _coordinator(store)
        solver = Solver(settings.solver_processes, settings.background_processes)
        service = JobService(settings, store, solver, metrics, coord)
        app.state.service = service
        tasks: set[asyncio.Task[None]] = set()
        app.state.tasks = tasks

        def start_precompute(rt: JobRuntime) -> None:
            rec = rt.record
            unplanned = rec.precompute_total == 0 or rec.precompute_done < rec.precompute_total
            name = f"precompute-{rec.id}"
            if unplanned and rec.state != "finished" and not any(t.get_name() == name for t in tasks):
                task = asyncio.create_task(precompute(service, rt), name=name)
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        service.on_new_job = start_precompute  # a job another replica registered: share its precompute
        sync = ReplicaSync(service)
        coord.start(asyncio.get_running_loop(), sync.on_change, sync.on_resync)
        runtimes = service.load()
        solver.start()
        for rt in runtimes:
            if rt.view is None or (rt.record.state == "needs_restore" and rt.record.restore_policy == "auto"):
                try:
                    await service.ensure_version(rt)
                except (PlannerError, ServiceError) as e:  # one job the planner refuses stops no other
                    log.error("job %s: no schedule version published at start-up: %s", rt.record.id, e)
                    continue
            start_precompute(rt)
        tasks.add(asyncio.create_task(heartbeat_loop(service)))
        gc.collect()
        gc.freeze()  # start-up objects leave the collector's generations: shorter pauses under load
        app.state.ready = True
        log.info("recycle service ready: %d jobs from %s", len(runtimes), store.path)
        try:
            yield
        finally:
            app.state.ready = False
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await service.stop()
            coord.stop()
            solver.shutdown()
            store.close()
            metrics.close()

    app = ServiceApp(
        title="recycle planner service",
        version="1",
        description="Fault-tolerant pipeline schedules for job controllers and polling workers.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    install_error_handlers(app)
    modules = (jobs, events, schedule, plan, health, pages)
    for module in modules:
        app.include_router(module.router)
    app.add_middleware(HeadMiddleware)  # inside the timing and body limit: they see the HEAD
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    # The routes by template for requests answered before routing (the included routers' own routes:
    # FastAPI wraps each included router in one entry of app.router.routes).
    routes = [*app.router.routes, *(r for module in modules for r in module.router.routes)]
    app.add_middleware(TimingMiddleware, metrics=metrics, routes=routes)
    return app
