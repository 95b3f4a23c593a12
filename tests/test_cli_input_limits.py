"""Inputs an outside audit found crashing or silently re-meant (session 9): files that are not UTF-8
or nest too deeply, float flags too large for a timedelta, --max-failures above D*P, a zero MTBF or
checkpoint interval taken as "not given", an empty strategy list, a --service URL without a scheme.
Each is now one line on stderr and exit 2, before any work starts."""

from __future__ import annotations

import json
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
