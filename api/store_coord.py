"""Coordination between service replicas: per-job locks, claims on planning work, wake-ups and shared
heartbeats. With SQLite (one process per store) LocalCoordinator makes all of it a no-op: the job's
asyncio lock is the only lock and memory is the truth. With PostgreSQL, api/store_pg_coord.py's
PgCoordinator does it in the database (advisory locks, LISTEN/NOTIFY, the heartbeats table).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Protocol

Worker = tuple[int, int]
Seen = tuple[str, int, int, float]  # a poll arrival: job id, d, s, wall-clock time
OnChange = Callable[[str, int], None]  # (job id, version) committed by some replica
OnResync = Callable[[], None]  # notifications may have been lost (reconnected): re-read everything


def lock_key(kind: str, name: str) -> int:
    """A signed 64-bit advisory lock key for `kind:name` (e.g. job:<id>, plan:<key>)."""
    digest = hashlib.blake2b(f"recycle:{kind}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class Coordinator(Protocol):
    shared: bool

    def start(self, loop: asyncio.AbstractEventLoop, on_change: OnChange, on_resync: OnResync) -> None: ...
    def stop(self) -> None: ...
    def job_lock(self, job_id: str) -> contextlib.AbstractAsyncContextManager[None]: ...
    def try_claim(self, key: str) -> bool: ...
    def release_claim(self, key: str) -> None: ...
    def publish_seen(self, rows: list[Seen], synced_at: float, check_s: float) -> None: ...
    def seen_within(self, job_id: str, workers: list[Worker], timeout_s: float) -> dict[Worker, float]: ...
    def seen_after(self, since: float) -> list[tuple[str, int, int, float]]: ...


class LocalCoordinator:
    """One service process per store: nothing to coordinate."""

    shared = False

    def start(self, loop: asyncio.AbstractEventLoop, on_change: OnChange, on_resync: OnResync) -> None:
        pass

    def stop(self) -> None:
        pass

    @contextlib.asynccontextmanager
    async def job_lock(self, job_id: str) -> AsyncIterator[None]:
        yield

    def try_claim(self, key: str) -> bool:
        return True

    def release_claim(self, key: str) -> None:
        pass

    def publish_seen(self, rows: list[Seen], synced_at: float, check_s: float) -> None:
        pass

    def seen_within(self, job_id: str, workers: list[Worker], timeout_s: float) -> dict[Worker, float]:
        return {}

    def seen_after(self, since: float) -> list[tuple[str, int, int, float]]:
        return []
