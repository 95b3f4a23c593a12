"""Failure normalization: scenarios equal up to a permutation of pipelines share one canonical key.

Every pipeline runs the same model with the same profile, so relabelling pipelines maps a valid
schedule to a valid schedule with the same iteration time. A scenario is reduced to the multiset
of per-pipeline signatures (its failed stages and slow factors); the canonical scenario numbers
pipelines by sorted signature. A plan is made once per key and mapped back to the physical workers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from planner.contract import FailureScenario, JobSpec, Schedule, SlowWorker, WorkerSchedule

Signature = tuple[tuple[int, ...], tuple[tuple[int, float], ...]]  # failed stages, (stage, factor) slow


@dataclass(frozen=True)
class Normalized:
    """A scenario in canonical form and the map back: canonical pipeline c is physical to_physical[c]."""

    key: str
    scenario: FailureScenario
    to_physical: tuple[int, ...]


def job_fingerprint(job: JobSpec) -> str:
    """A stable hash of everything in the job spec that planning depends on."""
    blob = json.dumps(job.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _signatures(scenario: FailureScenario, num_pipelines: int) -> dict[int, Signature]:
    """Every pipeline's signature (one pass over the scenario: simulate normalizes thousands)."""
    failed: dict[int, list[int]] = {}
    slow: dict[int, list[tuple[int, float]]] = {}
    for d, s in scenario.failed:
        failed.setdefault(d, []).append(s)
    for sw in scenario.slow:
        slow.setdefault(sw.worker[0], []).append((sw.worker[1], float(sw.factor)))
    return {
        d: (tuple(sorted(failed.get(d, ()))), tuple(sorted(slow.get(d, ())))) for d in range(num_pipelines)
    }


def normalize(job: JobSpec, scenario: FailureScenario) -> Normalized:
    """Canonical form of `scenario`: pipelines with failures first (most failures first), then slow.

    Raises InvalidInputError for a worker outside the job's grid: it would otherwise drop out of
    every pipeline's signature and the scenario would silently become failure-free."""
    scenario.check_grid(job)
    sigs = _signatures(scenario, job.num_pipelines)
    # Sort key puts touched pipelines first; ties keep physical order, which is irrelevant to the key.
    order = sorted(range(job.num_pipelines), key=lambda d: (not sigs[d][0], not sigs[d][1], sigs[d], d))
    failed = sorted((c, s) for c, d in enumerate(order) for s in sigs[d][0])
    slow = [SlowWorker(worker=(c, s), factor=f) for c, d in enumerate(order) for s, f in sigs[d][1]]
    canonical = FailureScenario(failed=failed, slow=slow)
    key_blob = json.dumps([job_fingerprint(job), [sigs[d] for d in order]], separators=(",", ":"))
    return Normalized(
        key=hashlib.sha256(key_blob.encode()).hexdigest()[:24], scenario=canonical, to_physical=tuple(order)
    )


def to_physical(schedule: Schedule, norm: Normalized, scenario: FailureScenario) -> Schedule:
    """Map a schedule planned for `norm.scenario` back onto the physical pipelines of `scenario`."""
    perm = norm.to_physical
    workers = []
    for ws in schedule.workers:
        actions = []
        for a in ws.actions:
            mb = None if a.mb is None else (perm[a.mb[0]], a.mb[1])
            actions.append(a.model_copy(update={"mb": mb}))
        workers.append(WorkerSchedule(worker=(perm[ws.worker[0]], ws.worker[1]), actions=actions))
    workers.sort(key=lambda w: (w.worker[1], w.worker[0]))
    return schedule.model_copy(
        update={
            "workers": workers,
            "failed": [tuple(w) for w in scenario.failed],
            "slow": list(scenario.slow) or None,
        }
    )
