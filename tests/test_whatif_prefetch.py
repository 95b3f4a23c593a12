"""simulate's baseline replays computed ahead in processes (whatif/prefetch.py), --job-mtbf, and the
warning on a trace dense with failures."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import whatif.prefetch
from planner.errors import InvalidInputError
from tests.jobs import uniform_job
from whatif import structured
from whatif.cli import _failure_sets, add_whatif_parsers
from whatif.prefetch import needed, prefetch
from whatif.strategies import Costs, make_strategies
from whatif.structured import Replayed, ReplayKey, replay
from whatif.trace import generate_trace

# 5 pipelines of 3 stages, 4 micro-batches: a failed worker's 4 micro-batches go to every peer, so no
# smaller grid gives the same figures and every baseline replay is of the whole grid.
JOB = uniform_job(5, 3, 4, optimizer_ms=0.5, activation_mib=1.0, weight_grad_mib=1.0)
EVENTS = generate_trace(JOB, mtbf_s=6 * 3600, repair_s=3600, duration_s=86400, seed=4)


@pytest.fixture(autouse=True)
def forget_replays() -> Iterator[None]:
    structured._remembered.clear()
    yield
    structured._remembered.clear()


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="recycle")
    add_whatif_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def figures(path: Path) -> dict[str, float]:
    return {name: fig["samples"] for name, fig in json.loads(path.read_text())["strategies"].items()}


def test_replays_computed_ahead_give_the_figures_of_the_run_that_replays_them_itself() -> None:
    strategies = make_strategies(JOB, Costs(), exact=False)
    sets = _failure_sets(EVENTS)
    keys = needed(JOB, strategies, sets)
    names = {key[0] for key in keys}
    # the ablations', shrink's and recycle+barrier's estimate's schedules
    assert names == {"naive-reroute", "zb-h1", "1f1b-survivors"}, names
    assert len(keys) == len(set(keys)) >= 4
    done = prefetch(JOB, strategies, sets, num_workers=2, progress=False)
    left = needed(JOB, strategies, sets)  # what raised in the processes, left to the run
    assert done + len(left) == len(keys) and done > len(left)
    for key in left:  # shrink with every pipeline hit
        with pytest.raises(InvalidInputError, match="every pipeline lost a worker"):
            replay(key)
    ahead = {key: structured.replayed(key) for key in keys if key not in left}
    structured._remembered.clear()
    assert {key: replay(key) for key in ahead} == ahead  # computed here: the same figures


def test_the_run_replays_only_what_the_processes_could_not(monkeypatch: pytest.MonkeyPatch) -> None:
    strategies = make_strategies(JOB, Costs(), exact=False)
    sets = _failure_sets(EVENTS)
    keys = needed(JOB, strategies, sets)
    prefetch(JOB, strategies, sets, num_workers=2, progress=False)
    left = needed(JOB, strategies, sets)
    here: list[ReplayKey] = []

    def counted(key: ReplayKey) -> Replayed:
        here.append(key)
        return replay(key)

    monkeypatch.setattr(structured, "replay", counted)
    for scenario in sets:
        for strategy in strategies.values():
            strategy.outcome(scenario)
    assert sorted(set(here)) == sorted(left) and len(left) < len(keys) / 10, (len(here), len(left))


def test_least_recently_used_replays_go_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(structured, "MAX_REMEMBERED", 2)
    a, b, c = (("zb-h1", JOB.model_dump_json(), sc.model_dump_json()) for sc in _failure_sets(EVENTS)[:3])
    for key in (a, b):
        structured.remember(key, (1.0, 1.0, None))
    structured.replayed(a)  # a hit: b is now the least recently used
    structured.remember(c, (1.0, 1.0, None))
    assert structured.is_remembered(a) and structured.is_remembered(c) and not structured.is_remembered(b)


def test_one_worker_or_a_warm_cache_computes_nothing_ahead() -> None:
    strategies = make_strategies(JOB, Costs(), exact=False)
    sets = _failure_sets(EVENTS)
    assert prefetch(JOB, strategies, sets, num_workers=1, progress=False) == 0
    for scenario in sets:  # the run evaluates every set: its records are now cached
        for strategy in strategies.values():
            strategy.outcome(scenario)
    structured._remembered.clear()
    # the baselines hold their records; recycle+barrier's estimate is not cached (it never is), so
    # only its ZB-H1 replays are left to do
    assert {key[0] for key in needed(JOB, strategies, sets)} == {"zb-h1"}


def _dies(key: ReplayKey) -> tuple[ReplayKey, Replayed | None]:
    Path(os.environ["DIED_MARK"]).touch()
    os._exit(3)  # a process of the pool killed mid-task


def test_a_killed_replay_process_leaves_the_rest_to_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = tmp_path / "t.csv", tmp_path / "plain.json"
    job_file = tmp_path / "job.json"
    job_file.write_text(JOB.model_dump_json())
    common = ["simulate", str(job_file), "--duration", "1d", "--seed", "4"]
    assert (
        run([*common, "--mtbf", "6h", "--repair", "1h", "--workers", "1", "--write-trace", str(trace)]) == 0
    )
    plain = run([*common, "--trace", str(trace), "--workers", "1", "--json", str(out)])
    assert plain == 0 and structured._remembered
    structured._remembered.clear()
    monkeypatch.setattr(whatif.prefetch, "_task", _dies)
    monkeypatch.setenv("DIED_MARK", str(tmp_path / "died"))
    broken = tmp_path / "broken.json"
    assert run([*common, "--trace", str(trace), "--workers", "2", "--json", str(broken)]) == 0
    assert (tmp_path / "died").exists()  # the replays ahead were tried, and their process died
    assert "a baseline replay process died: the run replays the other" in capsys.readouterr().err
    assert figures(broken) == figures(out)


def simulate_args(tmp_path: Path) -> list[str]:
    """`recycle simulate` of JOB over a generated day, without the MTBF."""
    job_file = tmp_path / "job.json"
    job_file.write_text(JOB.model_dump_json())
    return ["simulate", str(job_file), "--repair", "1h", "--duration", "1d", "--seed", "4", "--workers", "1"]


def test_job_mtbf_is_the_worker_mtbf_over_the_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = simulate_args(tmp_path)
    per_worker, per_job = tmp_path / "w.json", tmp_path / "j.json"
    assert run([*common, "--mtbf", "30h", "--json", str(per_worker)]) == 0  # 15 workers
    assert run([*common, "--job-mtbf", "2h", "--json", str(per_job)]) == 0
    assert figures(per_worker) == figures(per_job)
    assert json.loads(per_job.read_text())["job_mtbf_s"] == pytest.approx(7200)
    capsys.readouterr()
    with pytest.raises(SystemExit) as both:
        run([*common, "--mtbf", "30h", "--job-mtbf", "2h"])
    assert both.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="--job-mtbf must be above 0"):
        run([*common, "--job-mtbf", "0"])


def test_a_trace_dense_with_failures_is_warned_about_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("whatif.cli.DENSE_WORK", 0)
    monkeypatch.setattr("whatif.cli.DENSE_FAILURES", 30)  # 6h: ~60 failures, 2h job: ~12
    common = simulate_args(tmp_path)
    assert run([*common, "--mtbf", "6h"]) == 0
    err = capsys.readouterr().err
    assert "failures over 24 h (--mtbf 6 h is per worker: 24 min for the job's 15 workers" in err, err
    assert "--job-mtbf gives the job's MTBF" in err and "workers down at once" in err
    assert run([*common, "--job-mtbf", "2h"]) == 0  # few failures: no warning
    assert "warning" not in capsys.readouterr().err


def test_an_overflowing_job_mtbf_is_one_input_error(tmp_path: Path) -> None:
    # `--X=--` (no value): planner.cli.parse_args refuses it for every command (test_cli_usability)
    with pytest.raises(InvalidInputError, match="over 15 workers is too large"):
        run([*simulate_args(tmp_path), "--job-mtbf=1e304"])  # 1e304 h x 15 overflows to inf
