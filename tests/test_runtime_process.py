"""Runtime adapter with real worker processes (CPU, gloo): correctness, exactly-once, failures, re-join.

Schedules come from the planner here, in the test: the runtime adapter itself never plans.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from planner.contract import FailureScenario, JobSpec, Schedule
from planner.plan import plan
from runtime_adapter.accounting import committed, iteration_losses
from runtime_adapter.assignment import Worker
from runtime_adapter.launch import Launcher, LaunchSpec, publish
from runtime_adapter.model import GPTConfig, gpt_training
from runtime_adapter.reference import relative_error, train_reference
from tests.jobs import tiny_job

pytestmark = pytest.mark.timeout(300)

CFG = GPTConfig()
TOL = 1e-5


def planner_schedules(job: JobSpec) -> object:
    """schedule_for(failed set) backed by the greedy planner, cached per failure set."""
    cache: dict[frozenset[Worker], Schedule] = {}

    def schedule_for(failed: frozenset[Worker]) -> Schedule:
        if failed not in cache:
            cache[failed] = plan(job, FailureScenario(failed=sorted(failed)), use_cpsat=False).schedule
        return cache[failed]

    return schedule_for


def records(out: Path, w: Worker) -> list[dict]:
    """The accounting records a worker [d, s] (all its processes) wrote."""
    path = out / f"acct_{w[0]}_{w[1]}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def committed_hosts(out: Path, job: JobSpec) -> dict[tuple[int, int], list[list[int]]]:
    """(stage, iteration) -> micro-batches hosted in the step that counts: per (stage, iteration) only
    the records of the newest schedule version with a step survive (older ones were rolled back or
    died); at that version a "stepping" record without its "step" counts too (accounting.py)."""
    steps = committed(out, job.num_pipelines, job.num_stages)
    return {k: [mb for r in recs for mb in r["hosted"]] for k, recs in steps.items()}


@functools.lru_cache(maxsize=8)
def reference_losses(
    num_pipelines: int, num_stages: int, num_microbatches: int, num_iterations: int
) -> list[float]:
    """The global loss of each iteration of single-process training (mean over the D*M micro-batches
    of the unscaled loss, before that iteration's step), from train_reference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses: list[float] = []
        train_reference(
            gpt_training(CFG), num_pipelines, num_stages, num_microbatches, num_iterations, losses=losses
        )
        return losses
    finally:
        torch.set_num_threads(threads)


def assert_losses_match(out: Path, job: JobSpec, num_iterations: int) -> None:
    """Per iteration, the loss from the last stage's records equals single-process training's."""
    got = iteration_losses(out, job.num_pipelines, job.num_stages)
    ref = reference_losses(job.num_pipelines, job.num_stages, job.num_microbatches, num_iterations)
    assert sorted(got) == list(range(num_iterations)), got
    for it, loss in got.items():
        assert loss == pytest.approx(ref[it], rel=1e-5), f"iteration {it}: {loss} vs {ref[it]}"


def assert_exactly_once(out: Path, job: JobSpec, num_iterations: int) -> None:
    everything = sorted([d, m] for d in range(job.num_pipelines) for m in range(job.num_microbatches))
    hosts = committed_hosts(out, job)
    for s in range(job.num_stages):
        for it in range(num_iterations):
            assert sorted(hosts[(s, it)]) == everything, f"stage {s} iteration {it}: {sorted(hosts[(s, it)])}"


@functools.lru_cache(maxsize=8)
def reference(
    num_pipelines: int, num_stages: int, num_microbatches: int, num_iterations: int
) -> list[dict[str, torch.Tensor]]:
    """Single-process training, on one thread: the tiny model gains nothing from more, and on a busy
    2-core machine OpenMP threads spin (measured 10x slower with 2 threads at load average 6)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_reference(gpt_training(CFG), num_pipelines, num_stages, num_microbatches, num_iterations)
    finally:
        torch.set_num_threads(threads)


def assert_matches_reference(out: Path, job: JobSpec, num_iterations: int, workers: list[Worker]) -> None:
    ref = reference(job.num_pipelines, job.num_stages, job.num_microbatches, num_iterations)
    for d, s in workers:
        got = torch.load(out / f"final_{d}_{s}.pt")
        err = relative_error(got, ref[s])
        assert err < TOL, f"worker [{d}, {s}]: relative error {err:.2e} vs single-process training"


def assert_peers_identical(out: Path, job: JobSpec) -> None:
    for s in range(job.num_stages):
        states = [torch.load(out / f"final_{d}_{s}.pt") for d in range(job.num_pipelines)]
        for st in states[1:]:
            assert all(torch.equal(st[k], states[0][k]) for k in st), f"stage {s}: peers differ"


def launch(
    out: Path, job: JobSpec, num_iterations: int, fail_at: dict[Worker, tuple[int, str]] | None = None
) -> Launcher:
    spec = LaunchSpec(job, asdict(CFG), num_iterations, out, fail_at=fail_at or {})
    launcher = Launcher(spec, planner_schedules(job))  # type: ignore[arg-type]
    launcher.start()
    return launcher


@pytest.fixture(scope="module", params=[(2, 2), (3, 2)], ids=["d2p2", "d3p2"])
def failure_free(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    d, p = request.param
    job, out, n = tiny_job(d, p), tmp_path_factory.mktemp(f"ff{d}{p}"), 5
    codes = launch(out, job, n).wait(timedelta(seconds=240))
    assert all(rc == 0 for rc in codes.values()), codes
    return job, out, n


def test_failure_free_matches_single_process(failure_free) -> None:
    job, out, n = failure_free
    workers = [(d, s) for d in range(job.num_pipelines) for s in range(job.num_stages)]
    assert_matches_reference(out, job, n, workers)
    assert_peers_identical(out, job)


def test_exactly_once_accounting(failure_free) -> None:
    job, out, n = failure_free
    assert_exactly_once(out, job, n)
    for w in [(d, s) for d in range(job.num_pipelines) for s in range(job.num_stages)]:
        recs = records(out, w)
        for i, r in enumerate(recs):  # every step was announced right before its all-reduce
            if r["event"] == "step":
                intent = recs[i - 1]
                assert intent["event"] == "stepping" and (intent["it"], intent["version"]) == (
                    r["it"],
                    r["version"],
                )
                assert intent["hosted"] == r["hosted"]


def test_loss_in_the_step_records_matches_single_process(failure_free) -> None:
    job, out, n = failure_free
    last = job.num_stages - 1
    for d in range(job.num_pipelines):
        for s in range(job.num_stages):
            steps = [r for r in records(out, (d, s)) if r["event"] == "step"]
            assert all(("loss_sum" in r) == (s == last) for r in steps)
            assert all(r["loss_n"] == len(r["hosted"]) for r in steps if s == last)
    assert_losses_match(out, job, n)


def test_kill_in_each_phase_then_rejoin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 [1, 1] in iteration 3 before an F; each replacement re-joins from a peer and is killed
    again one iteration later before a B, a W, then the all-reduce; the last one stays. Survivors never
    restart; final parameters equal failure-free training; every injected fault fired once."""
    job, n, victim = tiny_job(2, 2), 12, (1, 1)
    monkeypatch.setenv("RECYCLE_GROUP_TIMEOUT_S", "60")
    launcher = launch(tmp_path, job, n, fail_at={victim: (3, "F")})
    for fault in [(1, "B"), (1, "W"), (1, "OPT"), None]:  # warm replacements, started now
        launcher.add_standby(victim, fault)

    def on_tick(lr: Launcher) -> None:
        if victim in lr.failed and lr.standbys.get(victim):
            lr.activate(victim)

    codes = launcher.wait(timedelta(seconds=280), on_tick)
    assert codes[victim] == 0 and all(rc == 0 for rc in codes.values()), codes
    deaths = [w for _, kind, w in launcher.events if kind == "died"]
    assert deaths == [victim] * 4, launcher.events
    assert sum(1 for p in launcher.retired if p.returncode == -9) == 4
    rejoins = [r for r in records(tmp_path, victim) if r["event"] == "rejoin"]
    assert len(rejoins) == 4
    survivors = [(0, 0), (0, 1), (1, 0)]
    for w in survivors:  # one process each: they were never restarted
        assert sum(1 for r in records(tmp_path, w) if r["event"] == "done") == 1
    assert_exactly_once(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, [*survivors, victim])
    assert_peers_identical(tmp_path, job)
    assert_losses_match(tmp_path, job, n)
    for w in survivors:  # the groups of old versions were destroyed, their threads gone
        versions = [r for r in records(tmp_path, w) if r["event"] == "version"]
        done = next(r for r in records(tmp_path, w) if r["event"] == "done")
        assert len(versions) >= 5, versions  # v1, then a fail and a rejoin per kill (some skipped)
        assert max(r["groups"] for r in versions) <= 6 and done["groups"] == 2, (versions, done)
        assert done["threads"] <= versions[0]["threads"] + 8, (versions, done)
    final = json.loads((tmp_path / "schedule.json").read_text())
    assert final["schedule"]["failed"] == []  # back to the failure-free schedule


def test_schedule_source_unreachable(tmp_path: Path) -> None:
    """The schedule file disappears mid-run: workers keep training on the last schedule, then pick up
    the version published when it is back."""
    job, n = tiny_job(2, 2), 30
    launcher = launch(tmp_path, job, n)
    path = launcher.schedule_path

    def steps() -> int:
        return min(sum(1 for r in records(tmp_path, w) if r["event"] == "step") for w in launcher.procs)

    deadline = time.monotonic() + 200
    while steps() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    path.unlink()
    before = steps()
    while steps() < before + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert steps() >= before + 3, "training stopped while the schedule source was away"
    publish(path, 2, planner_schedules(job)(frozenset()))  # type: ignore[operator]
    codes = launcher.wait(timedelta(seconds=200))
    assert all(rc == 0 for rc in codes.values()), codes
    versions = {r["version"] for w in launcher.procs for r in records(tmp_path, w) if r["event"] == "step"}
    assert versions == {1, 2}
    assert_exactly_once(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, list(launcher.procs))


def test_kill_right_after_the_allreduce(tmp_path: Path) -> None:
    """kill -9 of [1, 1] right after its gradient all-reduce of iteration 2 returned: its peer steps,
    it dies before its "step" record. Its "stepping" record, confirmed by the peer's step, keeps the
    accounting exact; survivors finish with the failure-free parameters and losses."""
    job, n, victim = tiny_job(2, 2), 5, (1, 1)
    codes = launch(tmp_path, job, n, fail_at={victim: (2, "REDUCED")}).wait(timedelta(seconds=240))
    survivors = [w for w in codes if w != victim]
    assert codes[victim] == -9 and all(codes[w] == 0 for w in survivors), codes
    mine = records(tmp_path, victim)
    assert mine[-1]["event"] == "stepping" and mine[-1]["it"] == 2, mine[-1]
    assert_exactly_once(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, survivors)
    assert_losses_match(tmp_path, job, n)
