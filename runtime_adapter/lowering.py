"""Lowering: a worker's order for one iteration -> a per-rank program with explicit sends and receives.

Each compute op becomes (receive its input) -> compute -> (send its output):

    F  at s > 0    : RECV_ACT from the host of (s-1, mb)    F    SEND_ACT to the host of (s+1, mb) (s < P-1)
    B/BW at s < P-1: RECV_GRAD from the host of (s+1, mb)  B    SEND_GRAD to the host of (s-1, mb) (s > 0)
    W              : W
    OPT            : OPT (gradient all-reduce among the stage's alive peers, then the optimizer step)

Hosts come from the schedule, so re-routed micro-batches get their cross-pipeline hops for free.
Sends are non-blocking (waited before OPT) and a receive blocks only right before the op that needs it,
so running a program is the replay of CONTRACT.md section 4: a schedule whose replay cannot deadlock
cannot deadlock here. `check_deadlock_free` re-checks that on the lowered programs themselves.
Messages are matched by tag (gloo); `fifo_violations` lists the channels whose send and receive orders
differ, which backends that match in order (NCCL) would need re-ordered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from runtime_adapter.assignment import Assignment, MicroBatch, Worker

RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD = "RECV_ACT", "SEND_ACT", "RECV_GRAD", "SEND_GRAD"
COMPUTE_OPS = ("F", "B", "W", "BW", "OPT")


@dataclass(frozen=True)
class Instr:
    """One step of a program: a compute op, or a send/receive of an activation or gradient."""

    kind: str
    mb: MicroBatch | None = None
    peer: Worker | None = None
    tag: int = 0

    def __str__(self) -> str:
        if self.kind in COMPUTE_OPS or self.peer is None:
            return self.kind if self.mb is None else f"{self.kind} mb={list(self.mb)}"
        assert self.mb is not None and self.peer is not None
        arrow = "<-" if self.kind.startswith("RECV") else "->"
        return f"{self.kind} mb={list(self.mb)} {arrow} {list(self.peer)} tag={self.tag}"


@dataclass(frozen=True)
class Program:
    """The lowered program of one worker for one iteration of schedule `version`."""

    worker: Worker
    version: int
    instrs: tuple[Instr, ...]

    def dry_run(self) -> str:
        """Human-readable listing, one instruction per line."""
        head = f"worker {list(self.worker)} schedule v{self.version}: {len(self.instrs)} instructions"
        return "\n".join([head, *(f"  {i:3d} {ins}" for i, ins in enumerate(self.instrs))])


def message_tag(kind: str, mb: MicroBatch, num_microbatches: int, num_pipelines: int) -> int:
    """Tag of an activation (F) or gradient (B) message of micro-batch `mb`; unique per iteration."""
    base = mb[0] * num_microbatches + mb[1]
    return base if kind == "act" else num_pipelines * num_microbatches + base


def lower(a: Assignment) -> Program:
    """The program of `a.worker`: its order with the sends and receives its hosts imply."""
    s, last = a.worker[1], a.num_stages - 1
    out: list[Instr] = []
    for op, mb in a.actions:
        if op == "OPT":
            out.append(Instr("OPT"))
            continue
        if mb is None:
            raise ValueError(f"worker {list(a.worker)}: {op} has no micro-batch")
        if op == "F":
            if s > 0:
                out.append(Instr(RECV_ACT, mb, _host(a.prev_host, mb, a.worker, s - 1), _tag("act", mb, a)))
            out.append(Instr("F", mb))
            if s < last:
                out.append(Instr(SEND_ACT, mb, _host(a.next_host, mb, a.worker, s + 1), _tag("act", mb, a)))
        elif op in ("B", "BW"):
            if s < last:
                peer = _host(a.next_host, mb, a.worker, s + 1)
                out.append(Instr(RECV_GRAD, mb, peer, _tag("grad", mb, a)))
            out.append(Instr(op, mb))
            if s > 0:
                peer = _host(a.prev_host, mb, a.worker, s - 1)
                out.append(Instr(SEND_GRAD, mb, peer, _tag("grad", mb, a)))
        elif op == "W":
            out.append(Instr("W", mb))
        else:
            raise ValueError(f"worker {list(a.worker)}: unknown op {op!r}")
    if not out or out[-1].kind != "OPT":
        raise ValueError(f"worker {list(a.worker)}: the order must end with OPT")
    return Program(a.worker, a.version, tuple(out))


def _tag(kind: str, mb: MicroBatch, a: Assignment) -> int:
    return message_tag(kind, mb, a.num_microbatches, a.num_pipelines)


def _host(table: Mapping[MicroBatch, Worker | None], mb: MicroBatch, worker: Worker, stage: int) -> Worker:
    host = table.get(mb)
    if host is None:
        raise ValueError(f"worker {list(worker)}: no host of micro-batch {list(mb)} at stage {stage}")
    return host


def check_deadlock_free(programs: Mapping[Worker, Program]) -> None:
    """Run the programs abstractly (sends never block, a receive waits for its message, OPT waits for
    every program of the same stage to reach OPT); raise ValueError naming the stuck workers if they
    cannot all finish, or if a message is never received."""
    pc = dict.fromkeys(programs, 0)
    in_flight: set[tuple[Worker, Worker, int]] = set()
    stages = {w[1] for w in programs}
    while True:
        progressed = False
        for w, prog in programs.items():
            while pc[w] < len(prog.instrs):
                ins = prog.instrs[pc[w]]
                if ins.kind in (SEND_ACT, SEND_GRAD):
                    assert ins.peer is not None
                    in_flight.add((w, ins.peer, ins.tag))
                elif ins.kind in (RECV_ACT, RECV_GRAD):
                    assert ins.peer is not None
                    key = (ins.peer, w, ins.tag)
                    if key not in in_flight:
                        break
                    in_flight.remove(key)
                elif ins.kind == "OPT":
                    break
                pc[w] += 1
                progressed = True
        for s in stages:
            peers = [w for w in programs if w[1] == s]
            if all(pc[w] == len(programs[w].instrs) - 1 for w in peers):
                for w in peers:
                    pc[w] += 1
                progressed = True
        if not progressed:
            break
    stuck = sorted(w for w, prog in programs.items() if pc[w] < len(prog.instrs))
    if stuck:
        detail = "; ".join(f"{list(w)} at {programs[w].instrs[pc[w]]}" for w in stuck)
        raise ValueError(f"the programs deadlock: {detail}")
    if in_flight:
        raise ValueError(f"messages sent but never received: {sorted(in_flight)}")


def fifo_violations(programs: Mapping[Worker, Program]) -> list[tuple[Worker, Worker]]:
    """Channels (src, dst) whose send order differs from the receive order (matters without tags)."""
    sends: dict[tuple[Worker, Worker], list[int]] = {}
    recvs: dict[tuple[Worker, Worker], list[int]] = {}
    for w, prog in programs.items():
        for ins in prog.instrs:
            if ins.kind in (SEND_ACT, SEND_GRAD):
                assert ins.peer is not None
                sends.setdefault((w, ins.peer), []).append(ins.tag)
            elif ins.kind in (RECV_ACT, RECV_GRAD):
                assert ins.peer is not None
                recvs.setdefault((ins.peer, w), []).append(ins.tag)
    return sorted(ch for ch in sends.keys() | recvs.keys() if sends.get(ch) != recvs.get(ch))
