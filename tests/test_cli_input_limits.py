"""Inputs an outside audit found crashing or silently re-meant (session 9): files that are not UTF-8
or nest too deeply, float flags too large for a timedelta, --max-failures above D*P, a zero MTBF or
checkpoint interval taken as "not given", an empty strategy list, a --service URL without a scheme,
an --out that is a file, a bare schedule given as a schedule envelope, a write error after the work.
Each is now one line on stderr and exit 2 (before any work starts where it can be known then)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recycle_cli import main

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "examples" / "gpt3-1.3b-p4d4.json")  # D=4, P=4


def refused(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and needle in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], err  # one error line (argparse adds its usage)


def test_a_job_file_that_is_not_utf8_or_nests_too_deeply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    utf16 = tmp_path / "job16.json"
    utf16.write_text(Path(JOB).read_text(), encoding="utf-16")  # what PowerShell's `>` writes
    refused(["plan", str(utf16), "--no-cpsat"], "is not UTF-8 text", capsys)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    refused(["plan", str(deep), "--no-cpsat"], "nested too deeply", capsys)
    trace = tmp_path / "trace16.csv"
    trace.write_text("time,worker,event\n1h,0:0,fail\n", encoding="utf-16")
    refused(
        ["simulate", JOB, "--trace", str(trace), "--strategies", "checkpoint-restart"], "not UTF-8", capsys
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", JOB, "--time-limit", "1e300"],
        ["whatif", JOB, "--time-limit", "1e13"],
        ["launch", "--job", JOB, "--schedules", "d", "--out", "o", "--timeout", "1e300"],
    ],
)
def test_float_flags_refuse_values_too_large(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    refused(argv, "is out of range", capsys)


def test_whatif_and_simulate_numbers_mean_what_they_say(capsys: pytest.CaptureFixture[str]) -> None:
    refused(["whatif", JOB, "--max-failures", "17"], "--max-failures 17: the job has 16 workers", capsys)
    refused(["simulate", JOB, "--mtbf", "0"], "--mtbf must be above 0", capsys)
    refused(["simulate", JOB, "--checkpoint-interval", "0"], "--checkpoint-interval must be above 0", capsys)
    refused(["whatif", JOB, "--strategies", " , "], "name at least one strategy", capsys)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--checkpoint-interval", "1e-9"], "checkpoints; at most 2,000,000 are simulated"),
        (["--checkpoint-cost", "1e-12"], "checkpoints; at most 2,000,000 are simulated"),
        (["--duration", "1e11s"], "failures; at most 1,000,000 are simulated"),
    ],
)
def test_simulate_refuses_a_run_it_cannot_finish(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each checkpoint and failure is a step of the timeline: these once ran for ever, growing."""
    refused(["simulate", JOB, "--mtbf", "6h", *flags], message, capsys)


@pytest.mark.parametrize("command", [["agent", "--workers", "0,0"], ["launch", "--job", JOB, "--out", "o"]])
def test_service_url_needs_a_scheme_and_host(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    refused([*command, "--service", "notaurl"], "is not an http:// or https:// URL", capsys)
    refused([*command, "--service", "http://"], "is not an http:// or https:// URL", capsys)


def test_profile_output_reads_back_without_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads(Path(JOB).read_text())
    for st in doc["stages"]:
        st["backward_fused_measured"] = st["backward_input"] + st["backward_weight"]  # as `recycle profile`
    job = tmp_path / "profiled.json"
    job.write_text(json.dumps(doc))
    out = tmp_path / "s.json"
    assert main(["plan", str(job), "--no-cpsat", "--time-limit", "2", "-o", str(out)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_write_errors_after_the_work_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    argv = [
        "simulate",
        JOB,
        "--strategies",
        "checkpoint-restart",
        "--duration",
        "24h",
        "--write-trace",
        "/dev/full",
    ]
    refused(argv, "--write-trace /dev/full: cannot write", capsys)


def test_bench_reads_every_job_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    refused(["bench", JOB, "--out", str(afile)], "exists and is not a directory", capsys)
    out = tmp_path / "results"
    refused(["bench", JOB, str(tmp_path / "missing.json"), "--out", str(out)], "cannot read job spec", capsys)
    assert not out.exists()  # nothing left behind for a run that did not start


def test_runtime_commands_check_out_and_schedule_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    launch = ["launch", "--job", JOB, "--schedules", str(tmp_path), "--iterations", "1"]
    refused([*launch, "--out", str(afile)], "exists and is not a directory", capsys)
    bare = tmp_path / "bare.json"  # what `recycle plan -o` writes: a schedule, not an envelope
    assert main(["plan", JOB, "--no-cpsat", "--time-limit", "1", "-o", str(bare)]) == 0
    capsys.readouterr()
    worker = ["worker", "--job", JOB, "--pipeline", "0", "--stage", "0", "--store", "127.0.0.1:1"]
    worker += ["--iterations", "1", "--out", str(tmp_path / "w"), "--schedule-file", str(bare)]
    refused(worker, "not a schedule envelope", capsys)


def test_trace_events_after_the_run_are_named_not_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "late.csv"
    trace.write_text("time,worker,event\n30d,0:0,fail\n")
    assert main(["simulate", JOB, "--trace", str(trace), "--strategies", "checkpoint-restart"]) == 0
    out = capsys.readouterr()
    assert "1 event(s) at or after --duration 168.0 h are not played" in out.err
    assert "0 failures over 168.0 h" in out.out
    figures = tmp_path / "figures.json"
    argv = ["simulate", JOB, "--trace", str(trace), "--strategies", "checkpoint-restart"]
    assert main([*argv, "--json", str(figures)]) == 0
    assert json.loads(figures.read_text())["num_failures"] == 0  # the JSON counted it


def test_validate_caps_the_replayed_iterations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sched = tmp_path / "s.json"
    assert main(["plan", JOB, "--no-cpsat", "--time-limit", "1", "-o", str(sched)]) == 0
    refused(
        ["validate", JOB, str(sched), "--iterations", "100000000"], "at most 1000 replayed iterations", capsys
    )
    doc = json.loads(sched.read_text())
    doc["replay_iterations"] = 10**8
    sched.write_text(json.dumps(doc))
    refused(["validate", JOB, str(sched)], "the schedule's replay_iterations 100000000", capsys)


def test_validate_a_schedule_whose_scenario_is_inconsistent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A schedule naming a worker both failed and slow was a pydantic traceback and exit 1."""
    base = tmp_path / "base.json"
    assert main(["plan", JOB, "--fail", "0,2", "--no-cpsat", "--time-limit", "1", "-o", str(base)]) == 0
    capsys.readouterr()
    doc = json.loads(base.read_text())
    doc["slow"] = [{"worker": [0, 2], "factor": 2.0}]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    refused(["validate", JOB, str(bad)], "is also listed as failed", capsys)


def test_precompute_refuses_more_failures_than_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(["precompute", JOB, "--max-failures", "17", "-o", str(tmp_path / "p")], "has 16 workers", capsys)
    assert not (tmp_path / "p").exists()


def test_ctrl_c_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """Ctrl+C in `recycle plan` printed a KeyboardInterrupt traceback. Sent while CP-SAT refines
    (planner/cpsat/solve.py): CP-SAT's own SIGINT handler swallowed a Ctrl+C during a search (the
    plan went on) and left SIGINT at its default after one (the process died without a word, -2).
    Now the search stops at once and the Ctrl+C is one line, exit 130."""
    job = str(ROOT / "examples" / "gpt3-6.7b-p8d4-mem1x.json")
    cmd = [sys.executable, "-m", "recycle_cli", "plan", job, "--fail", "1,2", "--fail", "2,5",
           "--time-limit", "60"]  # fmt: skip
    env = dict(os.environ, RECYCLE_GREEDY_BUDGET_S="1")  # reach the CP-SAT windows within seconds
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # progress lines, up to the one that says CP-SAT starts
        seen.append(line)
        if "cp-sat: refining" in line:
            break
    time.sleep(3)  # window steps of 2 s: one search has ended (SIGINT was left at default), one runs
    assert proc.poll() is None, "".join(seen)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", (proc.returncode, err)
    assert "Traceback" not in err, err
    assert time.monotonic() - sent < 10  # the search stopped, not ran out its 60 s


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_simulate_never_counts_more_stalled_time_than_the_run_has(tmp_path: Path, seed: int) -> None:
    """Failures every hour against restarts of about that length: restarts begun during another one
    were queued after it, and checkpoint-restart counted 45 h of recovery in a 24 h run."""
    out = tmp_path / "sim.json"
    argv = ["simulate", JOB, "--mtbf", "1h", "--repair", "10m", "--duration", "1d", "--seed", str(seed)]
    assert main([*argv, "--strategies", "recycle,checkpoint-restart,bamboo", "--json", str(out)]) == 0
    for name, fig in json.loads(out.read_text())["strategies"].items():
        stalled = fig["recovery_s"] + fig["checkpoint_s"] + fig["stalled_s"]
        assert stalled <= fig["duration_s"] * (1 + 1e-9), (name, stalled / 3600)
        assert min(fig["recovery_s"], fig["checkpoint_s"], fig["stalled_s"]) >= 0, (name, fig)


@pytest.mark.parametrize(
    ("target", "message"),
    [("/proc/recycle-x.json", "directory /proc is not writable"), ("/proc/version", "is not writable")],
)
def test_an_output_nothing_can_write_is_refused_before_planning(
    target: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """os.access says yes to root on /proc: the plan ran, then failed to write (outside review)."""
    if not Path("/proc/version").exists():
        pytest.skip("no /proc here")
    refused(["plan", JOB, "--fail", "0,1", "-o", target], message, capsys)


@pytest.mark.parametrize("command", [["plan", JOB], ["validate", JOB, "s.json"]])
def test_a_second_scenario_file_is_refused(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The last --scenario won and the first was dropped without a word."""
    refused([*command, "--scenario", "a.json", "--scenario", "b.json"], "--scenario given twice", capsys)
