"""The referee: structure checks, K-iteration replay and validation of schedules (CONTRACT.md 3-4).

It re-derives hosts, alive sets, slow factors and durations from the documents themselves and
shares no code with the schedule generators, so it can reject what they produce.
"""

from planner.simulator.engine import Replay, replay
from planner.simulator.report import ValidationReport, validate

__all__ = ["Replay", "ValidationReport", "replay", "validate"]
