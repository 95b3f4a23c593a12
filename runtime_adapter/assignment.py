"""A worker's view of one schedule version: its order, the hosts it exchanges with, its stage's peers.

Built either from a whole schedule document (schedule file) or from the service's per-worker answer
(GET /v1/jobs/{id}/schedule?worker=d,s), so the lowering and the executor never care where it came from.

Both envelopes may carry the restore protocol's optional fields (docs/runtime.md, "Restores and
fencing"): `restore` {epoch, iteration} (from the first restore on), `restore_policy` ("auto": a
`needs_restore` version is followed by a restore version; absent: "manual") and `joined_at` (the
service's worker view: a number; a schedule file: {"d,s": version} of every alive worker).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from planner.contract import Schedule

Worker = tuple[int, int]
MicroBatch = tuple[int, int]
Op = tuple[str, MicroBatch | None]


@dataclass(frozen=True)
class RestorePoint:
    """A version's `restore`: restore epoch `epoch` loads the checkpoint at stepped count `iteration`
    (None: the initial parameters and a fresh optimizer)."""

    epoch: int
    iteration: int | None


def parse_restore(doc: Mapping[str, Any]) -> RestorePoint | None:
    """The `restore` field of an envelope (None when absent: no restore yet)."""
    r = doc.get("restore")
    if not isinstance(r, Mapping):
        return None
    it = r.get("iteration")
    return RestorePoint(int(r["epoch"]), None if it is None else int(it))


def parse_joined_at(doc: Mapping[str, Any], worker: Worker) -> int | None:
    """`worker`'s `joined_at` in an envelope: a number (a worker view) or a {"d,s": v} map (a whole
    schedule's envelope); None when absent (no fencing information)."""
    j = doc.get("joined_at")
    if isinstance(j, Mapping):
        j = j.get(f"{worker[0]},{worker[1]}")
    return None if j is None else int(j)


@dataclass(frozen=True)
class Assignment:
    """What worker [d, s] runs under schedule `version`."""

    version: int
    worker: Worker
    num_pipelines: int
    num_stages: int
    num_microbatches: int
    failed: frozenset[Worker]
    actions: tuple[Op, ...]
    prev_host: Mapping[MicroBatch, Worker | None] = field(default_factory=dict)
    next_host: Mapping[MicroBatch, Worker | None] = field(default_factory=dict)
    stage_alive: tuple[Worker, ...] = ()
    state: str = "running"  # the job's state: "needs_restore" means a stage is lost, stop and restore
    restore: RestorePoint | None = None  # the latest restore (None: none yet)
    restore_policy: str = "manual"  # "auto": a needs_restore version is followed by a restore version
    joined_at: int | None = None  # the version since which this worker is continuously alive (fencing)
    partition: tuple[range, ...] | None = None  # the layers each stage holds (None: the job's own)
    migration_ms: float | None = None  # the schedule's `migration.estimated_ms` (the plan's estimate)

    @property
    def alive(self) -> bool:
        """Whether this worker has a place in the schedule."""
        return self.worker not in self.failed

    def alive_workers(self) -> list[Worker]:
        """Every alive worker of the job, sorted: the ranks of this version's world group."""
        return [
            (d, s)
            for d in range(self.num_pipelines)
            for s in range(self.num_stages)
            if (d, s) not in self.failed
        ]

    def hosted(self) -> list[MicroBatch]:
        """The micro-batches this worker hosts at its stage, in the order of their F."""
        return [mb for op, mb in self.actions if op == "F" and mb is not None]


def _w(x: Any) -> Worker:
    return (int(x[0]), int(x[1]))


def layer_fields(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The optional issue-12 fields of a schedule (or a worker view): `partition` (P half-open layer
    ranges) and `migration.estimated_ms`, as Assignment keyword arguments."""
    part = doc.get("partition")
    mig = doc.get("migration")
    est = mig.get("estimated_ms") if isinstance(mig, Mapping) else getattr(mig, "estimated_ms", None)
    return {
        "partition": None if part is None else tuple(range(int(a), int(b)) for a, b in part),
        "migration_ms": None if est is None else float(est),
    }


def assignment_from_schedule(
    schedule: Schedule, version: int, worker: Worker, num_pipelines: int, num_microbatches: int
) -> Assignment:
    """The assignment of `worker` in a whole schedule document."""
    num_stages = 1 + max(int(ws.worker[1]) for ws in schedule.workers)
    hosts: dict[tuple[int, MicroBatch], Worker] = {}
    orders: dict[Worker, list[Op]] = {}
    for ws in schedule.workers:
        w = _w(ws.worker)
        orders[w] = [(a.op, None if a.mb is None else _w(a.mb)) for a in ws.actions]
        for op, mb in orders[w]:
            if op == "F" and mb is not None:
                hosts[(w[1], mb)] = w
    failed = frozenset(_w(f) for f in schedule.failed)
    s = worker[1]
    actions = tuple(orders.get(worker, []))
    prev = {mb: hosts.get((s - 1, mb)) for op, mb in actions if op == "F" and mb is not None}
    nxt = {mb: hosts.get((s + 1, mb)) for op, mb in actions if op == "F" and mb is not None}
    return Assignment(
        version=version,
        worker=worker,
        num_pipelines=num_pipelines,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        failed=failed,
        actions=actions,
        prev_host=prev,
        next_host=nxt,
        stage_alive=tuple(sorted(w for w in orders if w[1] == s)),
        **layer_fields({k: getattr(schedule, k, None) for k in ("partition", "migration")}),
    )


def assignment_from_view(
    view: Mapping[str, Any], num_pipelines: int, num_stages: int, num_microbatches: int
) -> Assignment:
    """The assignment in the service's per-worker answer (`routes`, `stage_alive`, `actions`)."""
    prev: dict[MicroBatch, Worker | None] = {}
    nxt: dict[MicroBatch, Worker | None] = {}
    for r in view["routes"]:
        mb = _w(r["mb"])
        prev[mb] = None if r["prev_host"] is None else _w(r["prev_host"])
        nxt[mb] = None if r["next_host"] is None else _w(r["next_host"])
    actions = tuple((a["op"], None if a.get("mb") is None else _w(a["mb"])) for a in view["actions"])
    return Assignment(
        version=int(view["version"]),
        worker=_w(view["worker"]),
        num_pipelines=num_pipelines,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        failed=frozenset(_w(f) for f in view.get("failed", [])),
        actions=actions,
        prev_host=prev,
        next_host=nxt,
        stage_alive=tuple(sorted(_w(w) for w in view["stage_alive"])),
        state=str(view.get("state", "running")),
        **envelope_fields(view, _w(view["worker"])),
        **layer_fields(view),
    )


def envelope_fields(doc: Mapping[str, Any], worker: Worker) -> dict[str, Any]:
    """The restore protocol's fields of an envelope, as Assignment keyword arguments."""
    return {
        "restore": parse_restore(doc),
        "restore_policy": str(doc.get("restore_policy", "manual")),
        "joined_at": parse_joined_at(doc, worker),
    }


def assignments_from_schedule(
    schedule: Schedule, version: int, num_pipelines: int, num_microbatches: int
) -> dict[Worker, Assignment]:
    """Every alive worker's assignment (dry runs and tests)."""
    return {
        _w(ws.worker): assignment_from_schedule(
            schedule, version, _w(ws.worker), num_pipelines, num_microbatches
        )
        for ws in schedule.workers
    }
