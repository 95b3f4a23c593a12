"""Precedence family: the micro-batch dependencies of CONTRACT.md section 4, with their hop delays.

F at s waits for F at s-1 (+ hop), B at s for B at s+1 (+ hop), B at P-1 for F at P-1, W for B.
"""

from __future__ import annotations

from planner.cpsat.variables import CpSatVars, op_key


def add_precedences(v: CpSatVars) -> None:
    """Add every per-micro-batch dependency of one iteration."""
    p = v.problem
    last = p.num_stages - 1
    for d_mb in range(p.num_pipelines):
        for m in range(p.num_microbatches):
            mb = (d_mb, m)
            for s in range(p.num_stages):
                f, b, w = (op_key(p, s, mb, op) for op in ("F", "B", "W"))
                if s > 0:
                    prev = op_key(p, s - 1, mb, "F")
                    v.add(v.start[f] >= v.end(prev) + v.timing.hop(prev[0], f[0]))
                if s < last:
                    nxt = op_key(p, s + 1, mb, "B")
                    v.add(v.start[b] >= v.end(nxt) + v.timing.hop(nxt[0], b[0]))
                else:
                    v.add(v.start[b] >= v.end(f))
                v.add(v.start[w] >= v.end(b))
