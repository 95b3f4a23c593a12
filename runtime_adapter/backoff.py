"""Retry delays: exponential backoff with full jitter, shared by every retry loop of the runtime.

Without jitter, thousands of workers that lost the service at the same moment retry in lockstep and
hit it together when it comes back. With full jitter the n-th delay after a failure is uniform in
[0, min(cap, base * 2**n)]: the ceiling doubles as before, bounded by the cap, and each client draws
its own delays (each `Backoff` has its own random generator, seeded from the OS unless given one).
"""

from __future__ import annotations

import random


class Backoff:
    """Delays for successive failed attempts; `reset()` after a success."""

    def __init__(self, base_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        if base_s <= 0 or cap_s <= 0:
            raise ValueError(f"backoff base and cap must be positive, not {base_s}, {cap_s}")
        self.base_s, self.cap_s = base_s, cap_s
        self.rng = rng if rng is not None else random.Random()
        self.failures = 0

    def ceiling(self) -> float:
        """The largest delay the next `next()` can return."""
        return min(self.cap_s, self.base_s * 2.0 ** min(self.failures, 60))

    def next(self) -> float:
        """The delay to wait after one more failure: uniform in [0, ceiling()]."""
        delay = self.rng.uniform(0.0, self.ceiling())
        self.failures += 1
        return delay

    def reset(self) -> None:
        """The last attempt succeeded: start again from `base_s`."""
        self.failures = 0
