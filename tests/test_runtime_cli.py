"""`recycle worker` / `recycle launch`: bad input is a one-line error and exit 2, before any process
or connection is made; a worker that gets no schedule in time is one line and exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recycle_cli import main
from tests.jobs import uniform_job

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def job(tmp_path: Path) -> str:
    path = tmp_path / "job.json"
    path.write_text(uniform_job(2, 2, 4, name="cli-d2p2").model_dump_json())
    return str(path)


def worker_args(job: str, tmp_path: Path, *extra: str) -> list[str]:
    return ["worker", "--job", job, "--schedule-file", str(tmp_path / "s.json"), "--iterations", "1",
            "--out", str(tmp_path / "out"), *extra]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pipeline", "2", "--stage", "0", "--store", "h:1"], "not in the job's 2 x 2 grid"),
        (["--pipeline", "0", "--stage", "-1", "--store", "h:1"], "not in the job's 2 x 2 grid"),
        (["--pipeline", "0", "--stage", "0", "--store", "nohost"], "--store 'nohost'"),
        (["--pipeline", "0", "--stage", "0", "--store", "h:99999"], "--store 'h:99999'"),
        (["--pipeline", "0", "--stage", "0", "--store", "h:1", "--fail-at", "3"], "--fail-at '3'"),
        (["--pipeline", "0", "--stage", "0", "--store", "h:1", "--fail-at", "3:X"], "--fail-at '3:X'"),
        (["--pipeline", "0", "--stage", "0", "--store", "h:1", "--model", "{"], "--model '{'"),
        (["--pipeline", "0", "--stage", "0", "--store", "h:1", "--model", '{"hidden": 3}'], "multiple"),
        (["--pipeline", "0", "--stage", "0", "--store", "h:1", "--model", '{"nope": 1}'], "nope"),
        (["--pipeline", "0", "--stage", "0", "--store", "h:1", "--model", '{"num_heads": 0}'], "positive"),
        (["--pipeline", "0", "--stage", "0", "--store", "h:1", "--model", '{"hidden": 3.5}'], "whole"),
    ],
)
def test_worker_bad_input_exits_2(
    job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(worker_args(job, tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_launch_bad_input_exits_2(job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    assert main(["launch", "--job", str(tmp_path / "missing.json"), "--schedules", ".", "--out", out]) == 2
    assert "cannot read job spec" in capsys.readouterr().err
    assert main(["launch", "--job", job, "--schedules", str(tmp_path), "--out", out]) == 2
    assert "no plan index for this job" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_pipelines": 0}')
    assert main(["launch", "--job", str(bad), "--schedules", str(tmp_path), "--out", out]) == 2
    assert "not a valid job spec" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing started


def test_launch_status_line_follows_appended_accounting(tmp_path: Path) -> None:
    from runtime_adapter.progress import JobMonitor

    progress = JobMonitor(tmp_path, 2, 1, 4)
    progress.poll()
    assert progress.status_line(1, set(), 10) == "schedule v1: stepped 0-0 of 10 iterations"  # no file yet
    a, b = tmp_path / "acct_0_0.jsonl", tmp_path / "acct_1_0.jsonl"
    a.write_text('{"event": "step", "it": 0}\n{"event": "step", "it": 1}\n{"event": "st')  # torn line
    b.write_text('{"event": "step", "it": 0}\n')
    progress.poll()
    assert progress.status_line(1, set(), 10) == "schedule v1: stepped 1-2 of 10 iterations"
    with a.open("a") as f:
        f.write('ep", "it": 2}\n{"event": "rollback", "to": 2, "version": 2}\n')
    progress.poll()
    assert (
        progress.status_line(2, {(1, 0)}, 10) == "schedule v2: stepped 2-2 of 10 iterations, failed [[1, 0]]"
    )
    assert progress.iterations_done({(1, 0)}) == 2


def test_worker_rejects_a_model_with_fewer_layers_than_stages_and_bad_numbers(
    job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--pipeline", "0", "--stage", "0", "--store", "h:1"]
    assert main(worker_args(job, tmp_path, *base, "--model", '{"num_layers": 1}')) == 2
    assert "cannot be split into 2 stages" in capsys.readouterr().err
    assert main(worker_args(job, tmp_path, *base, "--pace-ms", "-1")) == 2
    assert "--pace-ms must be at least 0" in capsys.readouterr().err


def test_launcher_passes_a_token_that_starts_with_a_dash(job: str, tmp_path: Path) -> None:
    """Worker tokens may start with "-" (url-safe alphabet): the launcher's worker command must still
    hand them over as values, not flags (this once made every worker exit 2 at random)."""
    import argparse

    from planner.contract import JobSpec
    from runtime_adapter.cli import add_worker_parser
    from runtime_adapter.publishers import ServicePublisher

    spec = JobSpec.model_validate_json(Path(job).read_text())
    pub = ServicePublisher("http://127.0.0.1:1", "ctl", spec, job_id="-j1", worker_token="-tok-en")
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_worker_parser(parser.add_subparsers(dest="command"))
    argv = ["worker", "--job", job, "--pipeline", "0", "--stage", "0", "--store", "h:1", "--iterations", "1",
            "--out", str(tmp_path), *pub.worker_args()]  # fmt: skip
    args = parser.parse_args(argv)
    assert (args.service, args.job_id, args.token) == ("http://127.0.0.1:1", "-j1", "-tok-en")


def test_a_worker_given_no_schedule_in_time_says_why_in_one_line(job: str, tmp_path: Path) -> None:
    """Before: a TimeoutError traceback after RECYCLE_VERSION_WAIT_S, not naming the missing file."""
    args = worker_args(job, tmp_path, "--pipeline", "0", "--stage", "0", "--store", "127.0.0.1:1")
    env = {**os.environ, "RECYCLE_VERSION_WAIT_S": "1"}
    run = subprocess.run([sys.executable, "-m", "recycle_cli", *args], capture_output=True, text=True,
                         env=env, timeout=50)  # fmt: skip
    assert run.returncode == 1, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in run.stderr and len(errors) == 1, run.stderr
    assert "within 1 s (RECYCLE_VERSION_WAIT_S)" in errors[0] and "s.json: missing" in errors[0], run.stderr


def test_the_log_prefix_is_once_per_record_and_comes_off(caplog: pytest.LogCaptureFixture) -> None:
    """`recycle worker` run in-process on bad input (the tests here) used to leave its prefix filter on
    the root handlers, one more per call: later log lines of the process read `[0,0 v=0 it=0]` 18 times."""
    import logging

    from runtime_adapter.worker_options import install_log_prefix

    with caplog.at_level(logging.WARNING):
        removes = [install_log_prefix((1, 2)), install_log_prefix((1, 2))]
        logging.getLogger("recycle.test").warning("hello %d", 1)
        for remove in removes:
            remove()
        logging.getLogger("recycle.test").warning("after")
    assert [r.getMessage() for r in caplog.records] == ["[1,2 v=0 it=0] hello 1", "after"]
