"""The adaptive CP-SAT layer: improve a schedule's orders under a time limit, with a proven bound.

One steady-state iteration of period T is modelled (CONTRACT.md section 4); see build.py for the
families. Public API: `improve_orders`, `CpSatOutcome`, `SolveStatus`.
"""

from planner.cpsat.improve import CpSatOutcome, improve_orders
from planner.cpsat.solve import SolveStatus

__all__ = ["CpSatOutcome", "SolveStatus", "improve_orders"]
