"""The window re-solves of planner/cpsat/lns.py (tight memory): orders outside the window keep
their place, the result replays valid and never slower than the hint, and on a job where memory
does not cover the round trips they improve the greedy's plan; plan() uses them there."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from planner.adaptive.lookahead import round_trips_covered
from planner.bounds import load_bound, memory_bound
from planner.contract import FailureScenario, JobSpec
from planner.cpsat.hint import add_hint, hint_times
from planner.cpsat.lns import LnsOptions, _window_model, lns_orders
from planner.cpsat.solve import solve
from planner.cpsat.timing import IntTiming
from planner.normalize import normalize
from planner.plan import plan
from planner.portfolio import plan_greedy, redeferred
from planner.simulator import validate

ROOT = Path(__file__).resolve().parent.parent


def tight_job() -> JobSpec:
    """gpt3-1.3b-p4d4 with 6 micro-batches and room for two activations: no stage covers its trip."""
    doc = json.loads((ROOT / "examples" / "gpt3-1.3b-p4d4.json").read_text())
    doc["num_microbatches"] = 6
    doc["memory_capacity_mib"] = 2 * doc["stages"][0]["activation_mib"]
    return JobSpec.model_validate(doc)


def greedy_plan(job: JobSpec, failed: list[list[int]]):  # type: ignore[no-untyped-def]
    scenario = normalize(job, FailureScenario(failed=failed)).scenario
    return scenario, redeferred(plan_greedy(job, scenario, target_ms=memory_bound(job, scenario), budget_s=1))


def test_an_empty_window_keeps_the_hint() -> None:
    job = tight_job()
    scenario, best = greedy_plan(job, [[1, 1]])
    timing = IntTiming(best.problem)
    h = hint_times(best.problem, best.orders, timing)
    v = _window_model(best.problem, best.orders, h, timing, load_bound(job, scenario), 0.0, 0.0)
    assert not v.free_workers  # every worker is a chain: no freedom left
    add_hint(v, h)
    res = solve(v, datetime.timedelta(seconds=5))
    assert res.objective == h.period


def test_windows_improve_the_greedy_where_memory_binds() -> None:
    job = tight_job()
    scenario, best = greedy_plan(job, [[1, 1]])
    assert not round_trips_covered(job, scenario)
    seen: list[float] = []
    out = lns_orders(
        best.problem,
        best.orders,
        datetime.timedelta(seconds=10),
        load_bound(job, scenario),
        progress=lambda _s, ms: seen.append(ms),
        options=LnsOptions(step_s=2.0),
    )
    greedy_ms = best.schedule.iteration_time_ms
    assert out.improvements >= 1 and out.schedule.iteration_time_ms < greedy_ms - 1e-6  # 1.4375x -> ~1.427x
    assert seen == sorted(seen, reverse=True) and seen[-1] == out.schedule.iteration_time_ms
    report = validate(job, scenario, out.schedule)  # raises on a broken rule or memory over capacity
    assert abs(report.iteration_time_ms - out.schedule.iteration_time_ms) < 1e-6
    assert out.steps >= out.improvements


def test_plan_uses_the_windows_where_memory_binds_on_large_models() -> None:
    small = plan(tight_job(), FailureScenario(failed=[(1, 1)]), time_limit=datetime.timedelta(seconds=2))
    assert small.cpsat.get("method") is None  # 288 ops: the whole model
    job = JobSpec.model_validate_json((ROOT / "examples" / "gpt3-6.7b-p8d4-mem1x.json").read_text())
    result = plan(job, FailureScenario(failed=[(1, 2), (2, 5)]), time_limit=datetime.timedelta(seconds=3))
    assert result.cpsat["method"] == "windows" and result.cpsat["steps"] >= 1  # 1,536 ops
    assert result.iteration_time_ms <= result.greedy_ms + 1e-9


def test_large_models_get_one_stage_windows_without_presolve() -> None:
    small, large = LnsOptions.for_size(1_536), LnsOptions.for_size(6_100)  # 6.7b-mem1x, 13b-mem1x
    assert not small.one_stage and small.presolve
    assert large.one_stage and not large.presolve and large.step_s > small.step_s
