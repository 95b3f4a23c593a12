"""Restores and incarnations, as plain data: the checkpoints workers reported, the iteration a restore
loads, and since which version each worker has been continuously alive (`joined_at`, fencing).

The job record keeps (all persisted, api/records.py):

- `checkpoints`: {"<stage>": [the newest CHECKPOINTS_KEPT reported iterations, ascending]};
- `restore`: {"epoch", "iteration"} of the latest restore (None before the first);
- `joined`: {"base": v, "since": {"d,s": v}}: a worker's `joined_at` is `since["d,s"]` when present,
  else `base` (the first version, or the latest restore version: every worker joins anew there). Only
  re-joiners get an entry, so the record stays small for a large job.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Worker = tuple[int, int]

CHECKPOINTS_KEPT = 3  # per stage, like the writers' own retention (runtime_adapter/checkpoint.py KEEP)


def add_checkpoint(
    checkpoints: dict[str, list[int]], stages: Iterable[int], iteration: int
) -> dict[str, list[int]]:
    """`checkpoints` with `iteration` reported for every stage in `stages` (newest kept per stage)."""
    out = {k: list(v) for k, v in checkpoints.items()}
    for s in stages:
        its = set(out.get(str(s), []))
        its.add(int(iteration))
        out[str(s)] = sorted(its)[-CHECKPOINTS_KEPT:]
    return out


def restorable_iteration(checkpoints: dict[str, list[int]], num_stages: int) -> int | None:
    """The newest iteration every stage reported a checkpoint for, or None."""
    common: set[int] | None = None
    for s in range(num_stages):
        its = set(checkpoints.get(str(s), []))
        common = its if common is None else common & its
    return max(common) if common else None


def key(w: Worker) -> str:
    return f"{w[0]},{w[1]}"


def joined_after(
    joined: dict[str, Any], before: set[Worker], after: set[Worker], version: int, restore: bool
) -> dict[str, Any]:
    """The `joined` record after publishing `version` whose failed set is `after` (was `before`).

    The first version and a restore version: everyone joins there. Otherwise a worker failed before
    and alive now (a re-joiner) joins at `version`; a failed worker's entry is dropped."""
    if restore or not joined:
        return {"base": version, "since": {}}
    since = {k: v for k, v in joined.get("since", {}).items() if _worker(k) not in after}
    for w in before - after:
        since[key(w)] = version
    return {"base": int(joined["base"]), "since": since}


def joined_at(joined: dict[str, Any], w: Worker) -> int | None:
    """Since which version worker `w` has been alive (None: unknown, e.g. a job from an older store)."""
    if not joined:
        return None
    return int(joined.get("since", {}).get(key(w), joined["base"]))


def joined_map(joined: dict[str, Any], alive: Iterable[Worker]) -> dict[str, int]:
    """{"d,s": joined_at} of every alive worker (empty when unknown)."""
    if not joined:
        return {}
    return {key(w): int(joined.get("since", {}).get(key(w), joined["base"])) for w in sorted(alive)}


def _worker(text: str) -> Worker:
    d, s = text.split(",")
    return int(d), int(s)
