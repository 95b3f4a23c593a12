"""Serialized schedule answers, built once per (version, worker) and reused for every poller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pydantic_core

from api.restore import joined_at, joined_map

Worker = tuple[int, int]
LAYER_FIELDS = ("partition", "migration")  # a schedule's optional layer split, copied to worker views


def _dumps(obj: Any) -> bytes:
    return pydantic_core.to_json(obj)  # compact, UTF-8; several times faster than json.dumps


@dataclass
class VersionView:
    """One published version: its schedule document and lazily built, cached answers."""

    job_id: str
    version: int
    state: str
    source: str
    schedule: dict[str, Any]
    restore_policy: str = "auto"
    restore: dict[str, Any] | None = None  # the latest restore {epoch, iteration}; None before the first
    joined: dict[str, Any] = field(default_factory=dict)  # api/restore.py: joined_at of every worker
    _full: bytes | None = None
    _by_worker: dict[Worker, bytes] = field(default_factory=dict)
    _hosts: dict[tuple[int, Worker], Worker] | None = None
    _actions: dict[Worker, list[dict[str, Any]]] | None = None

    def full(self) -> bytes:
        """The whole schedule in an envelope (with `restore` from the first restore on, and `joined_at`
        of every alive worker: the same fields a launcher's schedule file carries)."""
        if self._full is None:
            doc: dict[str, Any] = {
                "job_id": self.job_id,
                "version": self.version,
                "state": self.state,
                "source": self.source,
                "restore_policy": self.restore_policy,
            }
            if self.restore is not None:
                doc["restore"] = self.restore
            alive = [(int(w["worker"][0]), int(w["worker"][1])) for w in self.schedule["workers"]]
            doc["joined_at"] = joined_map(self.joined, alive)
            doc["schedule"] = self.schedule
            self._full = _dumps(doc)
        return self._full

    def _index(self) -> None:
        hosts: dict[tuple[int, Worker], Worker] = {}
        actions: dict[Worker, list[dict[str, Any]]] = {}
        for ws in self.schedule["workers"]:
            w = (int(ws["worker"][0]), int(ws["worker"][1]))
            actions[w] = ws["actions"]
            for a in ws["actions"]:
                if a["op"] == "F":
                    hosts[(w[1], (int(a["mb"][0]), int(a["mb"][1])))] = w
        self._hosts, self._actions = hosts, actions

    def for_worker(self, worker: Worker) -> bytes:
        """Only `worker`'s order, the alive set of its stage, and the hosts it exchanges with."""
        cached = self._by_worker.get(worker)
        if cached is not None:
            return cached
        if self._actions is None:
            self._index()
        assert self._actions is not None and self._hosts is not None
        d, s = worker
        actions = self._actions.get(worker)
        routes = []
        for a in actions or []:
            if a["op"] != "F":
                continue
            mb = (int(a["mb"][0]), int(a["mb"][1]))
            prev = self._hosts.get((s - 1, mb))
            nxt = self._hosts.get((s + 1, mb))
            routes.append(
                {
                    "mb": list(mb),
                    "prev_host": None if prev is None else list(prev),
                    "next_host": None if nxt is None else list(nxt),
                }
            )
        doc: dict[str, Any] = {
            "job_id": self.job_id,
            "version": self.version,
            "state": self.state,
            "worker": [d, s],
            "alive": actions is not None,
            "iteration_time_ms": self.schedule["iteration_time_ms"],
            "failed": self.schedule.get("failed", []),
            "stage_alive": sorted([list(w) for w in self._actions if w[1] == s]),
            "routes": routes,
            "actions": actions or [],
            "restore_policy": self.restore_policy,
        }
        if self.restore is not None:
            doc["restore"] = self.restore
        for name in LAYER_FIELDS:  # issue 12: the layer split this version runs (re-partition jobs)
            if name in self.schedule:
                doc[name] = self.schedule[name]
        since = joined_at(self.joined, worker) if actions is not None else None
        if since is not None:
            doc["joined_at"] = since
        body = _dumps(doc)
        self._by_worker[worker] = body
        return body
