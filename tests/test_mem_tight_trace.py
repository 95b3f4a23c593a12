"""bench/idle_trace.py (`python -m bench.idle_breakdown --trace`): each wait it names is an op that
started after its input arrived, by exactly the time it reports, at a stage after the traced one;
the command prints the trace of a real -mem1x plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.idle_trace import ITERATIONS, trace_gaps
from planner.adaptive.tight import TightOptions, run_tight
from planner.contract import FailureScenario, JobSpec
from planner.normalize import normalize
from planner.orders import to_schedule
from planner.portfolio import host_variants
from planner.simulator.engine import _Clock, build_graph, topological_order
from planner.simulator.structure import OP_NAMES, check_structure

ROOT = Path(__file__).parents[1]
ARGS = ["--failed", "1,0", "--no-cpsat", "--trace", "--time-limit", "1"]


@pytest.mark.timeout(120)
def test_waits_are_exact_queueing_delays() -> None:
    job = JobSpec.model_validate_json((ROOT / "examples" / "gpt3-6.7b-p8d4-mem1x.json").read_text())
    scenario = normalize(job, FailureScenario(failed=[(1, 0)])).scenario
    problem = host_variants(job, scenario)[0]
    orders = run_tight(problem, TightOptions(num_iterations=4)).orders_by_iteration[-1]
    schedule = to_schedule(problem, orders, strategy="x")
    worker = max(problem.hosted_by_worker().items(), key=lambda kv: (kv[0][1] == 0, len(kv[1])))[0]
    gaps = trace_gaps(job, scenario, schedule, worker)
    assert gaps, "the default policy leaves middle gaps on this case"
    # The set of (stage, op, ms) queueing delays of the last replayed iteration, computed here directly.
    lay = check_structure(job, scenario, schedule)
    graph = build_graph(job, lay)
    clock = _Clock(lay, graph, topological_order(lay, graph))
    for _ in range(ITERATIONS):
        start, end = clock.iteration()
    delays = {
        (
            lay.workers[lay.node_worker[j]][1],
            OP_NAMES[lay.node_op[j]],
            round(start[j] - end[p] - graph.delay[j], 6),
        )
        for j, p in enumerate(graph.dep)
        if p >= 0 and start[j] > end[p] + graph.delay[j] + 1e-9
    }
    for _, gap, waits in gaps:
        assert gap > 0
        for w in waits:
            assert 1 <= w.stage < job.num_stages and w.ms > 0
            assert (w.stage, w.op, round(w.ms, 6)) in delays


@pytest.mark.timeout(120)
def test_trace_command_prints_the_summary() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.idle_breakdown", "examples/gpt3-6.7b-p8d4-mem1x.json", *ARGS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr
    assert "middle gaps of worker" in out.stdout
    assert "waits summed (stage, op waiting < op running):" in out.stdout


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--failed", "1,0", "1,0", "--no-cpsat"], "listed twice"),
        (["--failed", "1"], "--failed '1'"),
        (["--trace", "--stage", "9"], "--stage 9"),
        (["--stage", "1"], "--stage"),
    ],
)
def test_bad_input_is_named_and_exits_2(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.idle_breakdown import main

    job = str(Path(__file__).resolve().parents[1] / "examples" / "gpt3-1.3b-p4d4.json")
    try:
        code = main([job, *flags])
    except SystemExit as stop:  # argparse's own errors
        code = int(str(stop.code))
    assert code == 2
    out = capsys.readouterr()
    assert named in out.err and out.out == ""
