"""What a worker process does with each new schedule version under the restore protocol and fencing
(docs/runtime.md, "Restores and fencing"): pure decisions, kept apart from the worker loop.

- `needs_restore`: with restore policy "auto" the controller publishes the restore version next: wait
  for it; otherwise (policy "manual", or an envelope without the field) stop with EXIT_NEEDS_RESTORE.
- not alive: a fresh re-joiner waits for the version that includes it; anyone else leaves (dropped).
- a `restore` epoch above the process's own: load that checkpoint in place (or re-initialise), take
  the epoch and the version's `joined_at`, then recover as usual.
- fencing: the process remembers the `joined_at` of the first version it took part in; a later
  version that lists it alive since another version, with no newer restore epoch, means it was
  declared failed and replaced meanwhile (e.g. a partition that healed): it must leave without
  touching groups, steps, checkpoints or events.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from runtime_adapter.assignment import Assignment


class Verdict(enum.Enum):
    RUN = "run"  # recover under this version and train
    WAIT = "wait"  # wait for a newer version
    NEEDS_RESTORE = "needs_restore"  # exit EXIT_NEEDS_RESTORE
    DROPPED = "dropped"  # listed as failed: exit EXIT_DROPPED
    FENCED = "fenced"  # listed alive in another incarnation: exit EXIT_DROPPED, touching nothing
    RESTORE = "restore"  # load the restore's checkpoint in place, then run


@dataclass
class Incarnation:
    """One worker process's restore epoch and the version it joined at."""

    epoch: int = 0  # the restore epoch this process's state belongs to (--restore-epoch)
    joined: int | None = None  # joined_at of the first version it took part in (None: not yet/unknown)
    fenced: bool = False

    def judge(self, a: Assignment, fresh: bool = False) -> Verdict:
        """What to do with version `a` (see the module docstring); `fresh`: a re-joiner without state."""
        if a.state == "needs_restore":
            return Verdict.WAIT if a.restore_policy == "auto" else Verdict.NEEDS_RESTORE
        if not a.alive:
            return Verdict.WAIT if fresh else Verdict.DROPPED
        if a.restore is not None and a.restore.epoch > self.epoch:
            return Verdict.RESTORE
        if a.joined_at is not None and self.joined is not None and a.joined_at != self.joined:
            self.fenced = True
            return Verdict.FENCED
        return Verdict.RUN

    def took_part(self, a: Assignment) -> None:
        """This process takes part in version `a` (remember its first `joined_at`)."""
        if self.joined is None:
            self.joined = a.joined_at

    def restored(self, a: Assignment) -> None:
        """The process loaded `a`'s restore: it now belongs to that epoch and joined at `a`'s joined_at."""
        assert a.restore is not None
        self.epoch, self.joined = a.restore.epoch, a.joined_at
