"""Fields of an input document that recycle does not read: accepted, but named to the user.

CONTRACT.md welcomes extra optional fields, so a job spec or a failure scenario with a field the
models do not declare is valid. A misspelt field is valid too, and silently means something else:
`{"failed_workers": [[1, 2]]}` is the failure-free scenario. `unread_fields` lists every field of a
job spec or a failure scenario that is neither declared nor one of the extensions recycle reads
(docs/contract.md 1b) or writes, with the closest known name; the CLI prints them as warnings and the
service returns them with its answer.
"""

from __future__ import annotations

import difflib

from pydantic import BaseModel

from planner.contract import Comm, FailureScenario, JobSpec, SlowWorker, StageProfile

# Extensions recycle reads through the extras, or writes itself (`recycle profile` records the fused
# backward it measured), by the model that holds them.
KNOWN_EXTRAS: dict[type[BaseModel], frozenset[str]] = {
    JobSpec: frozenset({"layers", "model", "partition"}),
    Comm: frozenset({"migration_mib_per_ms"}),
    StageProfile: frozenset({"backward_fused_measured"}),
    FailureScenario: frozenset(),
    SlowWorker: frozenset(),
}


def unread_fields(doc: BaseModel, prefix: str = "") -> list[str]:
    """One line per field of `doc` (a job spec or failure scenario, nested models included) that
    recycle ignores, e.g. "failed_workers: not a field recycle reads, ignored (did you mean
    'failed'?)". Other documents (schedules) give no lines."""
    known_extras = KNOWN_EXTRAS.get(type(doc))
    if known_extras is None:
        return []
    lines = []
    declared = set(type(doc).model_fields)
    for name in doc.model_extra or {}:
        if name in known_extras:
            continue
        close = difflib.get_close_matches(name, sorted(declared | known_extras), n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        lines.append(f"{prefix}{name}: not a field recycle reads, ignored{hint}")
    for name in declared:
        value = getattr(doc, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                at = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                lines.extend(unread_fields(item, at))
    return lines
