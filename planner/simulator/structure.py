"""Structure rules of CONTRACT.md section 3, checked straight from the documents.

`check_structure` re-derives the alive workers, slow factors and hosts from the job spec, the
failure scenario and the schedule itself (never from the planner's `Problem`), rejects a schedule
that breaks a rule with a `ScheduleRuleError`, and returns a `Layout`: the schedule flattened into
integer-indexed arrays that the replay runs on.

Every op of the schedule is a *node* numbered in worker order: the nodes of the i-th listed worker
are `first[i] .. first[i+1]-1`, in the order the worker runs them. A (stage, micro-batch) pair is
a *key* `(s * D + d) * M + m`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, NoReturn, cast

from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import ScheduleRuleError

OP_F, OP_B, OP_W, OP_BW, OP_OPT = range(5)
OP_CODES = {"F": OP_F, "B": OP_B, "W": OP_W, "BW": OP_BW, "OPT": OP_OPT}
OP_NAMES = ("F", "B", "W", "BW", "OPT")


@dataclass
class Layout:
    """A structurally valid schedule as flat arrays (see the module docstring for the numbering)."""

    num_pipelines: int
    num_stages: int
    num_microbatches: int
    workers: list[tuple[int, int]]  # alive workers [d, s], in the schedule's listing order
    factor: list[float]  # slow factor per listed worker
    first: list[int]  # len(workers) + 1 entries
    node_worker: list[int]  # node -> index into workers
    node_op: list[int]  # node -> OP_* code
    node_key: list[int]  # node -> (stage, micro-batch) key, -1 for OPT
    f_node: list[int]  # key -> node of its F
    back_node: list[int]  # key -> node of its B or BW
    w_node: list[int]  # key -> node of its W, -1 when fused into BW

    @property
    def num_nodes(self) -> int:
        return len(self.node_op)

    def describe(self, node: int) -> str:
        """Human-readable name of a node, e.g. `B [1, 3] on worker [0, 2]`."""
        d, s = self.workers[self.node_worker[node]]
        op = OP_NAMES[self.node_op[node]]
        key = self.node_key[node]
        if key < 0:
            return f"{op} on worker [{d}, {s}]"
        mb_d, m = divmod(key % (self.num_pipelines * self.num_microbatches), self.num_microbatches)
        return f"{op} [{mb_d}, {m}] on worker [{d}, {s}]"


def _fmt(workers: set[tuple[int, int]]) -> str:
    return ", ".join(f"[{d}, {s}]" for d, s in sorted(workers)) or "none"


def _check_workers(job: JobSpec, scenario: FailureScenario, schedule: Schedule) -> None:
    if schedule.job != job.name:
        raise ScheduleRuleError(
            "job", f"schedule is for job {schedule.job!r} but the job spec is {job.name!r}"
        )
    failed = {(int(d), int(s)) for d, s in scenario.failed}
    stated = {(int(d), int(s)) for d, s in schedule.failed}
    if stated != failed:
        raise ScheduleRuleError(
            "failed-set",
            f"schedule's failed set differs from the scenario's: listed but not failed: "
            f"{_fmt(stated - failed)}; failed but not listed: {_fmt(failed - stated)}",
        )
    num_d, num_p = job.num_pipelines, job.num_stages
    seen: set[tuple[int, int]] = set()
    for ws in schedule.workers:
        w = (int(ws.worker[0]), int(ws.worker[1]))
        if w[0] >= num_d or w[1] >= num_p:
            raise ScheduleRuleError(
                "workers",
                f"worker [{w[0]}, {w[1]}] is outside the job's grid ({num_d} pipelines x {num_p} stages)",
            )
        if w in failed:
            raise ScheduleRuleError("workers", f"worker [{w[0]}, {w[1]}] has failed but has an order")
        if w in seen:
            raise ScheduleRuleError("workers", f"worker [{w[0]}, {w[1]}] is listed twice")
        seen.add(w)
    alive = {(d, s) for d in range(num_d) for s in range(num_p)} - failed
    if seen != alive:
        raise ScheduleRuleError("workers", f"alive workers without an order: {_fmt(alive - seen)}")


def _check_opt(w: tuple[int, int], ops: Sequence[str]) -> None:
    opt_at = [i for i, op in enumerate(ops) if op == "OPT"]
    where = f"worker [{w[0]}, {w[1]}]"
    if not opt_at:
        raise ScheduleRuleError("opt", f"{where} has no OPT")
    if len(opt_at) > 1:
        raise ScheduleRuleError("opt", f"{where} has {len(opt_at)} OPTs (positions {opt_at})")
    if opt_at[0] != len(ops) - 1:
        raise ScheduleRuleError(
            "opt", f"{where}: OPT at position {opt_at[0]} is not its last action (of {len(ops)})"
        )


def check_structure(job: JobSpec, scenario: FailureScenario, schedule: Schedule) -> Layout:
    """Check every structure rule of CONTRACT.md section 3 and flatten the schedule.

    Raises InvalidInputError / UnrecoverableScenarioError for a scenario that does not fit the job,
    and ScheduleRuleError (rule ids: job, failed-set, workers, mb-range, opt, coverage,
    mixed-backward, host, order) for a schedule that breaks a rule.
    """
    scenario.check_against(job)
    _check_workers(job, scenario, schedule)
    rows = (
        ((int(ws.worker[0]), int(ws.worker[1])), [a.op for a in ws.actions], [a.mb for a in ws.actions])
        for ws in schedule.workers
    )
    return _flatten(job, scenario, rows)


class _Listed(NamedTuple):
    worker: tuple[int, int]


class _Listing(NamedTuple):
    job: str
    failed: list[tuple[int, int]]
    workers: list[_Listed]


def check_orders(
    job: JobSpec,
    scenario: FailureScenario,
    orders: Sequence[tuple[tuple[int, int], Sequence[tuple[str, tuple[int, int] | None]]]],
) -> Layout:
    """check_structure for the schedule whose workers, in this listing order, run these orders
    (each ending with ("OPT", None)), without the schedule document: the same rules, the same Layout.
    The entries are taken as well-formed (an op name of CONTRACT.md, an mb for every op but OPT),
    which the schedule document's own validation guarantees."""
    scenario.check_against(job)
    listing = _Listing(
        job.name, [(int(d), int(s)) for d, s in scenario.failed], [_Listed(w) for w, _ in orders]
    )
    _check_workers(job, scenario, cast(Schedule, listing))
    rows = ((w, [op for op, _ in order], [mb for _, mb in order]) for w, order in orders)
    return _flatten(job, scenario, rows)


def _flatten(
    job: JobSpec,
    scenario: FailureScenario,
    rows: Iterable[tuple[tuple[int, int], Sequence[str], Sequence[tuple[int, int] | None]]],
) -> Layout:
    """The Layout of workers given as (worker, op names, micro-batches): the order, coverage, host
    and range rules checked on the way."""
    num_d, num_p, num_m = job.num_pipelines, job.num_stages, job.num_microbatches
    num_keys = num_p * num_d * num_m
    tables = [[-1] * num_keys for _ in (OP_F, OP_B, OP_W, OP_BW)]  # op code -> key -> node
    workers: list[tuple[int, int]] = []
    first: list[int] = []
    node_worker: list[int] = []
    node_op: list[int] = []
    node_key: list[int] = []
    codes = OP_CODES
    for wi, (w, ops, all_mbs) in enumerate(rows):
        workers.append(w)
        _check_opt(w, ops)
        j0 = len(node_op)
        first.append(j0)
        node_worker.extend([wi] * len(ops))
        node_op.extend([codes[op] for op in ops])
        # Every action but the last (the OPT) has an mb: Action's own validator guarantees it.
        mbs = cast(list[tuple[int, int]], all_mbs[:-1])
        for i, (mb_d, m) in enumerate(mbs):
            if mb_d >= num_d or m >= num_m:
                raise ScheduleRuleError(
                    "mb-range",
                    f"worker [{w[0]}, {w[1]}]: {ops[i]} names micro-batch [{mb_d}, {m}], outside "
                    f"{num_d} pipelines x {num_m} micro-batches",
                )
        base = w[1] * num_d
        keys = [(base + mb_d) * num_m + m for mb_d, m in mbs]
        node_key.extend(keys)
        node_key.append(-1)
        for j, code, key in zip(range(j0, j0 + len(keys)), node_op[j0:], keys, strict=False):
            table = tables[code]
            if table[key] >= 0:
                dims = (num_d, num_m)
                _raise_duplicate(workers, node_worker, ops[j - j0], key, (table[key], j), dims)
            table[key] = j
    first.append(len(node_op))
    lay = Layout(
        num_pipelines=num_d,
        num_stages=num_p,
        num_microbatches=num_m,
        workers=workers,
        factor=[scenario.slow_factor(w) for w in workers],
        first=first,
        node_worker=node_worker,
        node_op=node_op,
        node_key=node_key,
        f_node=tables[OP_F],
        back_node=[b if b >= 0 else bw for b, bw in zip(tables[OP_B], tables[OP_BW], strict=True)],
        w_node=tables[OP_W],
    )
    _check_coverage(lay, tables[OP_B], tables[OP_BW])
    return lay


def _raise_duplicate(
    workers: list[tuple[int, int]],
    node_worker: list[int],
    op: str,
    key: int,
    nodes: tuple[int, int],
    dims: tuple[int, int],
) -> NoReturn:
    num_d, num_m = dims
    s, rest = divmod(key, num_d * num_m)
    mb_d, m = divmod(rest, num_m)
    a, b = (workers[node_worker[x]] for x in nodes)
    raise ScheduleRuleError(
        "coverage",
        f"micro-batch [{mb_d}, {m}] at stage {s}: {op} appears twice "
        f"(on worker [{a[0]}, {a[1]}] and on worker [{b[0]}, {b[1]}])",
    )


def _check_coverage(lay: Layout, b_node: list[int], bw_node: list[int]) -> None:
    """Each (stage, micro-batch) has F + (B, W) or F + BW, on one host, F before B before W."""
    num_dm = lay.num_pipelines * lay.num_microbatches
    nw = lay.node_worker
    for key, (f, b, w, bw) in enumerate(zip(lay.f_node, b_node, lay.w_node, bw_node, strict=True)):
        if f >= 0 and bw >= 0 and b < 0 and w < 0 and nw[f] == nw[bw] and f < bw:
            continue  # the fused case, valid
        if f >= 0 and b >= 0 and w >= 0 and bw < 0 and nw[f] == nw[b] == nw[w] and f < b < w:
            continue  # the split case, valid
        s, rest = divmod(key, num_dm)
        mb_d, m = divmod(rest, lay.num_microbatches)
        what = f"micro-batch [{mb_d}, {m}] at stage {s}"
        if bw >= 0 and (b >= 0 or w >= 0):
            present = [n for n, x in (("F", f), ("B", b), ("W", w), ("BW", bw)) if x >= 0]
            raise ScheduleRuleError("mixed-backward", f"{what} has both BW and B/W ({', '.join(present)})")
        missing = [n for n, x in (("F", f), ("B", b), ("W", w)) if x < 0]
        if bw >= 0:
            missing = [n for n in missing if n == "F"]
        elif b < 0 and w < 0:
            missing = [n for n in missing if n == "F"] + ["backward (neither BW nor B and W)"]
        if missing:
            raise ScheduleRuleError("coverage", f"{what} has no {', '.join(missing)}")
        nodes = [x for x in (f, b, w, bw) if x >= 0]
        hosts = {lay.workers[nw[x]] for x in nodes}
        if len(hosts) > 1:
            placed = "; ".join(lay.describe(x) for x in nodes)
            raise ScheduleRuleError("host", f"{what} runs on more than one host: {placed}")
        back = bw if bw >= 0 else b
        if f > back:
            raise ScheduleRuleError("order", f"{what}: {lay.describe(back)} comes before its F")
        raise ScheduleRuleError("order", f"{what}: W comes before its B on {_fmt(hosts)}")
