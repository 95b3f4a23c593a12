"""Optimizer family: each worker's OPT waits for the last W of every alive peer of its stage.

One variable per stage holds the end of the stage's last W, so the all-reduce rule costs
O(ops) constraints instead of O(ops x peers).
"""

from __future__ import annotations

from planner.cpsat.variables import CpSatVars


def add_optimizer_steps(v: CpSatVars) -> None:
    """OPT start >= end of every W of stage s + allreduce_ms(s), for every alive worker of stage s."""
    p = v.problem
    for s in range(p.num_stages):
        last = v.model.new_int_var(0, v.horizon, f"last_W_end_s{s}")
        v.last_w_end[s] = last
        for d in p.alive[s]:
            for key in v.ops_of[d, s]:
                if key[3] == "W":
                    v.add(last >= v.end(key))
        ar = v.timing.allreduce(s)
        for d in p.alive[s]:
            v.add(v.opt_start[d, s] >= last + ar)
