"""A schedule as a Chrome trace (JSON Trace Event Format), to open in Perfetto or chrome://tracing.

One process per stage (pid = s, named "stage s"), one thread per worker (tid = pipeline d, named
"worker [d,s]"), one complete event (ph "X") per action, using the informative first-iteration
start_ms/end_ms of the schedule. Times in the trace are microseconds, as the format requires.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from planner.contract import Action, JobSpec, Schedule

logger = logging.getLogger(__name__)

_US_PER_MS = 1000.0


def _us(ms: float) -> float:
    # Rounded to the nanosecond so 2.1 ms prints as 2100.0 and not 2100.0000000000005.
    return round(ms * _US_PER_MS, 3)


def _event_name(action: Action) -> str:
    if action.mb is None:
        return action.op
    return f"{action.op} {action.mb[0]},{action.mb[1]}"


def _metadata(name: str, pid: int, args: dict[str, Any], tid: int | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def to_chrome_trace(schedule: Schedule, job: JobSpec) -> dict[str, Any]:
    """The schedule as a Chrome trace dict: {"traceEvents", "displayTimeUnit", "otherData"}.

    Events are deterministic: metadata first (stages, then workers by stage and pipeline, failed
    workers named "worker [d,s] failed"), then each worker's actions in its order. An action is
    `rerouted` when its micro-batch belongs to another pipeline than the worker's.
    """
    if schedule.job != job.name:
        logger.warning("schedule is for job %r but the job spec is %r", schedule.job, job.name)
    alive = sorted(schedule.workers, key=lambda w: (w.worker[1], w.worker[0]))
    failed = sorted((int(d), int(s)) for d, s in schedule.failed)
    stages = sorted({int(w.worker[1]) for w in alive} | {s for _, s in failed})

    events: list[dict[str, Any]] = []
    for s in stages:
        events.append(_metadata("process_name", s, {"name": f"stage {s}"}))
        events.append(_metadata("process_sort_index", s, {"sort_index": s}))
    labelled = [((int(w.worker[0]), int(w.worker[1])), "") for w in alive]
    labelled += [(worker, " failed") for worker in failed]
    for (d, s), suffix in sorted(labelled, key=lambda item: (item[0][1], item[0][0])):
        events.append(_metadata("thread_name", s, {"name": f"worker [{d},{s}]{suffix}"}, tid=d))
        events.append(_metadata("thread_sort_index", s, {"sort_index": d}, tid=d))

    for ws in alive:
        d, s = int(ws.worker[0]), int(ws.worker[1])
        for action in ws.actions:
            mb = None if action.mb is None else [int(action.mb[0]), int(action.mb[1])]
            events.append(
                {
                    "name": _event_name(action),
                    "cat": action.op,
                    "ph": "X",
                    "ts": _us(action.start_ms),
                    "dur": _us(max(0.0, action.end_ms - action.start_ms)),
                    "pid": s,
                    "tid": d,
                    "args": {"mb": mb, "rerouted": mb is not None and mb[0] != d, "worker": [d, s]},
                }
            )

    other: dict[str, Any] = {
        "format": schedule.format,
        "job": job.name,
        "num_pipelines": job.num_pipelines,
        "num_stages": job.num_stages,
        "num_microbatches": job.num_microbatches,
        "failed": [[d, s] for d, s in failed],
        "iteration_time_ms": schedule.iteration_time_ms,
    }
    if schedule.strategy is not None:
        other["strategy"] = schedule.strategy
    if schedule.slow:
        other["slow"] = [{"worker": list(sw.worker), "factor": sw.factor} for sw in schedule.slow]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(schedule: Schedule, job: JobSpec, path: str | Path) -> None:
    """Write `to_chrome_trace(schedule, job)` as compact JSON to `path` (one event per line)."""
    trace = to_chrome_trace(schedule, job)
    lines = [json.dumps(e, separators=(",", ":")) for e in trace["traceEvents"]]
    head = {k: v for k, v in trace.items() if k != "traceEvents"}
    text = (
        '{"traceEvents":[\n'
        + ",\n".join(lines)
        + "\n],\n"
        + json.dumps(head, separators=(",", ":"))[1:]
        + "\n"
    )
    Path(path).write_text(text, encoding="utf-8")
    logger.info("wrote Chrome trace with %d events to %s", len(lines), path)
