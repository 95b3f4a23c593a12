"""whatif.structured: the baselines replayed on a reduced grid give exactly the full replay's figures."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from planner.baselines import baseline_schedule
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError, ScheduleRuleError
from planner.normalize import normalize
from planner.plan import baseline_1f1b_ms
from planner.simulator.engine import replay
from planner.simulator.report import check_capacity
from whatif.structured import baseline_times, failure_free_1f1b_ms, reduced_case

ROOT = Path(__file__).resolve().parent.parent
NAMES = ("1f1b", "naive-reroute", "zb-h1", "1f1b-survivors")


def small_job(pipelines: int, microbatches: int, tight_memory: bool = False) -> JobSpec:
    job = JobSpec.model_validate_json((ROOT / "examples" / "gpt3-1.3b-p4d4.json").read_text())
    update: dict[str, object] = {"num_pipelines": pipelines, "num_microbatches": microbatches}
    if tight_memory:  # zb-h1 then runs deferred W early: the capacity path of the orders
        prof = job.stages[0]
        update["memory_capacity_mib"] = 3 * prof.activation_mib + prof.weight_grad_mib
    return job.model_copy(update=update)


def full(name: str, job: JobSpec, scenario: FailureScenario) -> tuple[float, float]:
    sched = baseline_schedule(name, job, scenario)
    check_capacity(job, replay(job, scenario, sched).peak_memory_mib)  # the validator's memory rule
    return sched.iteration_time_ms, max(a.end_ms for ws in sched.workers for a in ws.actions)


def cases(job: JobSpec) -> list[FailureScenario]:
    workers = [(d, s) for d in range(job.num_pipelines) for s in range(job.num_stages)]
    out = [FailureScenario()]
    out += [FailureScenario(failed=[w]) for w in workers]
    rng = random.Random(7)
    for k in (2, 3):
        out += [FailureScenario(failed=sorted(rng.sample(workers, k))) for _ in range(12)]
    return out


@pytest.mark.parametrize("pipelines,microbatches,tight", [(12, 2, False), (9, 3, True), (7, 4, False)])
def test_structured_baselines_equal_the_full_replay(pipelines: int, microbatches: int, tight: bool) -> None:
    job = small_job(pipelines, microbatches, tight)
    reduced = over_memory = 0
    for scenario, name in itertools.product(cases(job), NAMES):
        for sc in (scenario, normalize(job, scenario).scenario):  # as given, and normalized
            try:
                want = full(name, job, sc)
            except (InvalidInputError, ScheduleRuleError) as exc:
                with pytest.raises(type(exc)) as got:
                    baseline_times(name, job, sc)
                if isinstance(exc, ScheduleRuleError):
                    assert isinstance(got.value, ScheduleRuleError) and got.value.rule == exc.rule == "memory"
                    over_memory += 1
                continue
            assert baseline_times(name, job, sc) == want, (name, sc.failed)  # bitwise equal
            reduced += reduced_case(name, job, sc) is not None
    assert reduced > 50  # the structure was used, not only the fallback
    assert (over_memory > 0) == tight  # a re-routed peer's extra activations break the tight capacity


def test_failure_free_1f1b_is_one_pipeline_and_equals_the_planner_figure() -> None:
    job = small_job(16, 5)
    small, _ = reduced_case("1f1b", job, FailureScenario()) or (None, None)
    assert small is not None and small.num_pipelines == 1
    assert failure_free_1f1b_ms(job) == baseline_1f1b_ms(job)


def test_llama3_shaped_grid_reduces_to_a_few_pipelines() -> None:
    """128 pipelines: a failure set in normalized form keeps the failed and receiving pipelines."""
    job = small_job(128, 16)
    three = FailureScenario(failed=[(0, 1), (1, 2), (2, 3)])
    for name in ("naive-reroute", "zb-h1"):
        case = reduced_case(name, job, three)
        assert case is not None and case[0].num_pipelines <= 3 + 3 * 16 + 1
    case = reduced_case("1f1b-survivors", job, three)
    assert case is not None and case[0].num_pipelines < 64
