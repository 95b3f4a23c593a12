"""What a new user hit with `recycle`: output paths, picture formats, unknown flags, figures that
read wrong, help texts. The real console command runs as a subprocess where the exit path matters."""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli_summary import fmt_gap
from planner.contract import Schedule
from planner.figures import derived_figures
from recycle_cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "gpt3-1.3b-p4d4.json"
RECYCLE = shutil.which("recycle", path=str(Path(sys.executable).parent)) or "recycle"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RECYCLE, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def one_line_error(r: subprocess.CompletedProcess[str], needle: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert r.stdout == ""  # refused before planning: no table


# ---------------------------------------------------------------- 1, 2: output paths and formats


def test_plan_creates_missing_directories_and_writes_svg(tmp_path: Path) -> None:
    out, svg, trace = tmp_path / "a/b/s.json", tmp_path / "c/g.svg", tmp_path / "d/t.json"
    r = run(
        "plan",
        str(JOB),
        "--fail",
        "1,2",
        "--no-cpsat",
        "-o",
        str(out),
        "--gantt",
        str(svg),
        "--trace",
        str(trace),
    )
    assert r.returncode == 0, r.stderr
    assert "iteration time (ms)" in r.stdout
    assert json.loads(out.read_text())["failed"] == [[1, 2]]
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert "T = " in text  # the iteration time is marked on the axis (text kept as SVG text)
    assert json.loads(trace.read_text())["traceEvents"]


@pytest.mark.parametrize("flag", ["-o", "--gantt", "--trace"])
def test_unwritable_output_fails_before_planning(tmp_path: Path, flag: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker / "sub" / ("x.png" if flag == "--gantt" else "x.json")
    one_line_error(run("plan", str(JOB), flag, str(target)), "it is a file")


def test_output_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    one_line_error(run("plan", str(JOB), "-o", str(tmp_path)), "is a directory")


@pytest.mark.parametrize("name", ["g.jpg", "g", "g.pdf"])
def test_gantt_refuses_other_picture_types(tmp_path: Path, name: str) -> None:
    one_line_error(run("plan", str(JOB), "--gantt", str(tmp_path / name)), "use .png or .svg")


def test_whatif_and_simulate_check_outputs_first(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    for argv, needle in [
        (["whatif", str(JOB), "--plot", str(tmp_path / "p.gif")], "use .png or .svg"),
        (["whatif", str(JOB), "--json", str(blocker / "w.json")], "it is a file"),
        (["simulate", str(JOB), "--write-trace", str(blocker / "t.csv")], "it is a file"),
        (["simulate", str(JOB), "--plot", str(tmp_path / "p.jpeg")], "use .png or .svg"),
        (["precompute", str(JOB), "-o", str(blocker)], "not a directory"),
        (["whatif", str(JOB), "--plans", str(blocker / "plans")], "it is a file"),
    ]:
        one_line_error(run(*argv), needle)


# ---------------------------------------------------------------- 3: unknown flags


def _subcommands() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


@pytest.mark.parametrize("command", _subcommands())
def test_unknown_flag_prints_the_subcommand_usage(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: recycle {command}"), err


def test_unknown_flag_after_complete_command_names_it() -> None:
    r = run("plan", str(JOB), "--bogus")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("usage: recycle plan")
    assert "recycle plan: error: unrecognized arguments: --bogus" in r.stderr


def test_unknown_top_level_flag_stays_top_level(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--bogus", "plan", str(JOB)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("usage: recycle [-h]")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["plan", str(JOB), "--time-limit=--"], "--time-limit"),  # a typed flag
        (["plan", str(JOB), "--fail", "0,0", "--fail=--"], "--fail"),  # an appending flag
        (["validate", str(JOB), "s.json", "--iterations=--"], "--iterations"),
        (["simulate", str(JOB), "--repair=--"], "--repair"),
        (["serve", "--port=--"], "--port"),
    ],
)
def test_a_flag_given_as_equals_dashdash_has_no_value(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    # argparse drops the "--" of `--X=--` and stores [] without calling the flag's type: the
    # command got a list for a number or a path (a TypeError traceback in plan and simulate)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"error: argument {flag}: expected one argument" in capsys.readouterr().err


AGENT_ARGS = ["agent", "--service", "http://127.0.0.1:1", "--job-id", "j", "--token", "t"]
AGENT_ARGS += ["--workers", "0,0", "--store", "127.0.0.1:1", "--iterations", "1"]


@pytest.mark.parametrize(
    ("entry", "argv", "flag"),
    [
        ("api.cli", ["--port=--"], "--port"),
        ("runtime_adapter.cli", ["store", "--port=--"], "--port"),
        (
            "runtime_adapter.agent_cli",
            [*AGENT_ARGS, "--pace-ms=--"],
            "--pace-ms",
        ),
    ],
)
def test_the_standalone_entry_points_refuse_equals_dashdash_too(
    capsys: pytest.CaptureFixture[str], entry: str, argv: list[str], flag: str
) -> None:
    # `python -m api.cli` (docker), `python -m runtime_adapter.cli` (launched workers), the agent
    entry_main = importlib.import_module(entry).main
    with pytest.raises(SystemExit) as exc:
        entry_main(argv)
    assert exc.value.code == 2
    assert f"error: argument {flag}: expected one argument" in capsys.readouterr().err


def test_a_list_flag_given_as_equals_dashdash_has_no_items(capsys: pytest.CaptureFixture[str]) -> None:
    # `bench --cases=--` stored [] and ran every case
    with pytest.raises(SystemExit) as exc:
        main(["bench", str(JOB), "--cases=--"])
    assert exc.value.code == 2
    assert "error: argument --cases: expected at least one argument" in capsys.readouterr().err


def test_a_flag_left_at_an_empty_default_is_not_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # `plan`'s --fail defaults to []: only a given empty value is refused
    assert main(["plan", str(JOB), "--no-cpsat", "--time-limit=1"]) == 0


# ---------------------------------------------------------------- 4, 6: figures


def test_plan_names_both_references_and_shows_slow_workers() -> None:
    r = run("plan", str(JOB), "--fail", "0,0", "--slow", "1,1:3", "--no-cpsat")
    assert r.returncode == 0, r.stderr
    assert "throughput retained vs failure-free 1F1B" in r.stdout
    assert "failure-free plan of this planner (ms)" in r.stdout
    assert "throughput retained vs that plan" in r.stdout
    assert "[1,1] x3" in r.stdout and "[0,0]" in r.stdout
    j = run("plan", str(JOB), "--fail", "0,0", "--slow", "1,1:3", "--no-cpsat", "--json")
    fig = json.loads(j.stdout)
    assert fig["slow"] == [{"worker": [1, 1], "factor": 3.0}]
    for old in ("throughput_retained", "baseline_1f1b_ms", "gap_to_lower_bound", "validation", "source"):
        assert old in fig
    own = fig["own_failure_free_ms"]
    assert own > 0 and fig["throughput_retained_vs_own_failure_free"] == pytest.approx(
        own / fig["iteration_time_ms"]
    )
    assert fig["throughput_retained_vs_1f1b"] == fig["throughput_retained"]


def test_failure_free_plan_is_its_own_reference() -> None:
    fig = json.loads(run("plan", str(JOB), "--no-cpsat", "--json").stdout)
    assert fig["own_failure_free_ms"] == fig["iteration_time_ms"]
    assert fig["throughput_retained_vs_own_failure_free"] == 1.0


def test_validate_prints_the_figures_plan_prints(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    plan = run("plan", str(JOB), "--fail", "2,1", "--slow", "0,0:1.5", "--no-cpsat", "-o", str(out))
    assert plan.returncode == 0, plan.stderr
    v = run("validate", str(JOB), str(out))
    assert v.returncode == 0, v.stderr
    for label in (
        "slow workers (factor)",
        "[0,0] x1.5",
        "throughput retained vs failure-free 1F1B",
        "load lower bound (ms)",
        "memory-aware bound (ms)",
        "gap to memory-aware bound",
        "bubble ratio",
        "peak MiB",
    ):
        assert label in v.stdout, label
        assert label in plan.stdout, label
    for solver_only in ("planned by", "greedy", "cp-sat"):
        assert solver_only not in v.stdout
    fig = json.loads(run("validate", str(JOB), str(out), "--json").stdout)
    assert fig["valid"] is True and fig["slow"] == [{"worker": [0, 0], "factor": 1.5}]
    assert {"memory_bound_ms", "throughput_retained", "gap_to_memory_bound_clamped"} <= set(fig)


# ---------------------------------------------------------------- 5: gaps below zero


def test_negative_gap_is_clamped_and_explained() -> None:
    assert fmt_gap(0.01505) == "1.505%"
    assert fmt_gap(-1e-14) == "0.000%"
    assert fmt_gap(-4e-6) == "0.000%"
    shown = fmt_gap(-4e-5)
    assert shown.startswith("0.000% (measured -0.004%") and "docs/planner.md" in shown
    assert "-" not in shown.split("(")[0]
    deep = fmt_gap(-0.64)  # no transient: a bound taken on the wrong job once printed this as noise
    assert deep.startswith("-64.000%") and "bug" in deep and "float noise" not in deep


def test_negative_gap_json_keeps_raw_value_and_flags_it() -> None:
    sched = Schedule.model_validate({"job": "j", "failed": [], "iteration_time_ms": 99.996, "workers": []})
    fig = {"iteration_time_ms": 99.996, "gap_to_lower_bound": -4e-5, "gap_to_memory_bound": 0.01}
    out = derived_figures(fig, sched)
    assert out["gap_to_lower_bound"] == -4e-5 and out["gap_to_lower_bound_clamped"] == 0.0
    assert out["gap_to_memory_bound_clamped"] == 0.01
    assert out["measured_below_bound"] is True
    fig["gap_to_lower_bound"] = 0.0
    assert derived_figures(fig, sched)["measured_below_bound"] is False


# ---------------------------------------------------------------- 7: help texts


@pytest.mark.parametrize("command", ["plan", "validate", "whatif", "simulate", "precompute", "bench"])
def test_help_cites_the_repository_contract(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "CONTRACT.md" not in text


@pytest.mark.parametrize(("command", "default"), [("whatif", "default 3"), ("precompute", "default 2")])
def test_max_failures_help_gives_default_and_meaning(
    command: str, default: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-failures" in text and default in text and "0, 1, ..., K failed workers" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "JOB", "--time-limit", "nan"],
        ["bench", "JOB", "--time-limit", "inf"],
        ["whatif", "JOB", "--time-limit", "nan"],
        ["precompute", "JOB", "-o", "plans", "--time-limit=-inf"],
        ["launch", "--job", "JOB", "--schedules", "d", "--out", "o", "--timeout", "nan"],
        ["launch", "--job", "JOB", "--schedules", "d", "--out", "o", "--pace-ms", "inf"],
        [
            "worker",
            "--job",
            "JOB",
            "--pipeline",
            "0",
            "--stage",
            "0",
            "--schedule-file",
            "f",
            "--store",
            "h:1",
            "--iterations",
            "1",
            "--out",
            "o",
            "--pace-ms",
            "nan",
        ],
    ],
)
def test_float_flags_refuse_nan_and_infinity(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([a.replace("JOB", "examples/gpt3-1.3b-p4d4.json") for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "is not a finite number" in err and "Traceback" not in err
