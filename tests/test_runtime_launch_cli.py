"""`recycle launch` end to end with stand-in workers (tiny Python scripts instead of torch workers, so
each case takes about a second): start-up errors, a stage lost without checkpoints, the loss lines,
loss.csv, the summary, and the service's job id and page. No traceback in any output."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from recycle_cli import main
from runtime_adapter.launch_spec import LaunchSpec
from tests.jobs import precomputed_inputs, uniform_job

pytestmark = pytest.mark.timeout(60)

JOB = uniform_job(2, 2, 2, name="launch-fake")

# argv: out_dir d s mode. Writes step records (the last stage with loss fields) like a worker.
FAKE_WORKER = """
import json, os, signal, sys, time
out, d, s, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if mode == "bad-config":
    print("INFO building stage", flush=True)
    print("Traceback (most recent call last):")
    print('  File "model.py", line 90, in stage_layers')
    print("ValueError: need at least one block per stage: 1 blocks for 2 stages")
    sys.exit(1)
if mode == "lose-stage-1" and s == 1:  # die only after this pipeline's stage 0 wrote its steps
    first = os.path.join(out, f"acct_{d}_0.jsonl")
    for _ in range(2000):
        if os.path.exists(first) and open(first).read().count("\\n") >= 3:
            break
        time.sleep(0.01)
with open(os.path.join(out, f"acct_{d}_{s}.jsonl"), "a") as f:
    for it in range(3):
        rec = {"event": "step", "it": it, "version": 1}
        if s == 1:
            rec.update(loss_sum=2.0 * (3 - it), loss_n=2)
        f.write(json.dumps(rec) + "\\n")
        f.flush()
        if mode == "lose-stage-1" and s == 1 and it == 1:
            os.kill(os.getpid(), signal.SIGKILL)
if mode == "lose-stage-1":
    time.sleep(30)
"""


@pytest.fixture
def fake_workers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    mode = ["ok"]

    def command(
        self: LaunchSpec, worker: tuple[int, int], store_port: int, *args: object, **kwargs: object
    ) -> list[str]:
        return [sys.executable, "-c", FAKE_WORKER, str(self.out_dir), str(worker[0]), str(worker[1]), mode[0]]

    monkeypatch.setattr(LaunchSpec, "command", command)
    return mode


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return precomputed_inputs(tmp_path_factory.mktemp("inputs"), JOB)


def launch(inputs: tuple[str, str], out: Path, *extra: str) -> list[str]:
    return [
        "launch",
        "--job",
        inputs[0],
        "--schedules",
        inputs[1],
        "--out",
        str(out),
        "--timeout",
        "50",
        *extra,
    ]


def test_training_prints_loss_outputs_and_summary(
    inputs: tuple[str, str], fake_workers: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(launch(inputs, tmp_path / "run", "--iterations", "3")) == 0
    out, err = capsys.readouterr()
    for where in ("worker_<d>_<s>.log", "acct_<d>_<s>.jsonl", "loss.csv", "final_<d>_<s>.pt", "checkpoints"):
        assert where in out
    assert "iteration   0/2  loss 3.0000  schedule v1  alive 4/4" in out
    assert "iteration   2/2  loss 1.0000  schedule v1  alive 4/4" in out
    assert "summary: 3/3 iterations, last schedule v1, loss 1.0000 at iteration 2" in out
    assert "failures: none" in out and "Traceback" not in out + err
    rows = (tmp_path / "run" / "loss.csv").read_text().splitlines()
    assert rows == ["iteration,loss,version", "0,3,1", "1,2,1", "2,1,1"]
    assert (tmp_path / "run" / "worker_1_1.pid").read_text().strip().isdigit()


def test_a_worker_error_during_start_up_stops_the_launch(
    inputs: tuple[str, str], fake_workers: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_workers[0] = "bad-config"
    assert main(launch(inputs, tmp_path / "run")) == 1
    out, err = capsys.readouterr()
    assert "stopped during start-up with exit code 1" in err
    assert "ValueError: need at least one block per stage" in err
    assert "Traceback" not in out + err and "restor" not in out + err and "lost" not in out + err


def test_a_lost_stage_without_checkpoints_says_so(
    inputs: tuple[str, str],
    fake_workers: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake_workers[0] = "lose-stage-1"
    assert main(launch(inputs, tmp_path / "run", "--iterations", "3")) == 1
    out, err = capsys.readouterr()
    assert "stage(s) [1] lost (all their workers failed): no checkpoint exists (checkpointing is off" in err
    assert "restoring" not in out + err + caplog.text and "Traceback" not in out + err
    assert "iteration   1/2  loss 2.0000" in out
    assert "worker [0, 1] died in iteration 2 (exit -9)" in out
    assert "worker [0, 0]: exit -9 (stopped by the launcher)" in out
    assert "summary: 2/3 iterations" in out


def test_bad_flags_exit_2_before_anything_starts(
    inputs: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    cases = [
        (["--iterations", "0"], "--iterations must be at least 1, not 0"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be at least 0"),
        (["--pace-ms", "-5"], "--pace-ms must be at least 0"),
        (["--timeout", "0"], "--timeout must be above 0"),
        (["--print-every", "0"], "--print-every must be at least 1"),
        (["--store-port", "70000"], "--store-port 70000"),
        (["--model", '{"num_layers": 1}'], "cannot be split into 2 stages"),
        (["--model", '{"clip_scope": "x"}'], "clip_scope must be 'stage' or 'global'"),  # also without clip
    ]
    for extra, message in cases:
        assert main(launch(inputs, out, *extra)) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["launch", "--job", inputs[0], "--service", "http://127.0.0.1:1", "--out", str(out),
                 "--max-failures", "-1"]) == 2  # fmt: skip
    assert "--max-failures must be at least 0" in capsys.readouterr().err
    assert main(launch(inputs, out, "--max-failures", "2")) == 2  # --schedules
    assert "--max-failures: only with --service" in capsys.readouterr().err
    assert main(launch(inputs, out, "--heartbeat-timeout", "0")) == 2  # the launcher's own, with --schedules
    assert "--heartbeat-timeout must be above 0" in capsys.readouterr().err
    assert main(["launch", "--job", inputs[0], "--service", "http://127.0.0.1:1", "--out", str(out),
                 "--plan-on-demand"]) == 2  # fmt: skip
    assert "--plan-on-demand goes with --schedules" in capsys.readouterr().err
    assert not out.exists()


def test_service_job_id_and_page_are_printed(
    inputs: tuple[str, str], fake_workers: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from runtime_adapter.publishers import ServicePublisher

    def start(self: ServicePublisher) -> None:
        self.job_id, self.worker_token, self.version = "job42", "tok", 1

    monkeypatch.setattr(ServicePublisher, "start", start)
    monkeypatch.setattr(ServicePublisher, "finish", lambda self: None)
    argv = ["launch", "--job", inputs[0], "--service", "http://svc:8000/", "--controller-token", "c",
            "--out", str(tmp_path / "run"), "--iterations", "3"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "service job job42: page http://svc:8000/jobs/job42" in out


def test_help_states_defaults_and_points_at_docs_contract(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "docs/contract.md" in text and "CONTRACT.md" not in text
    assert "up to this many failed workers (default 1)" in text
    assert "recycle precompute JOB -o DIR" in text and "--store-port" in text
    json.dumps(text)  # printable


def test_restores_without_a_complete_checkpoint_start_from_iteration_0(
    inputs: tuple[str, str], fake_workers: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checkpointing on, but no checkpoint written (stand-in workers): every restore version says
    `iteration: null` and the launcher restarts the workers that are not running from iteration 0
    (survivors that load in place keep running: stand-ins just sleep); stage 1 is lost again each
    time, so the 4th loss gives up (exit 1)."""

    fake_workers[0] = "lose-stage-1"
    assert main(launch(inputs, tmp_path / "run", "--iterations", "3", "--checkpoint-every", "1")) == 1
    out, err = capsys.readouterr()
    restarting = "[0, 1], [1, 1]"  # only the dead stage-1 workers: the survivors load in place
    line = f"stage(s) [1] lost (all their workers failed): restore from iteration 0, restarting {restarting}"
    assert out.count(line) == 3, out
    assert "more than 3 restores, giving up" in err and "Traceback" not in out + err
    assert "restores from a checkpoint: 3" in out
    assert f"restored from scratch (no complete checkpoint), restarting {restarting}" in out
    doc = json.loads((tmp_path / "run" / "schedule.json").read_text())
    assert doc["restore"] == {"epoch": 4, "iteration": None} and doc["state"] == "running", doc


def test_a_store_port_in_use_is_bad_input(
    inputs: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(launch(inputs, tmp_path / "run", "--store-port", str(port))) == 2
    err = capsys.readouterr().err
    assert f"--store-port {port}: cannot listen there" in err and "Traceback" not in err


def test_a_dry_run_with_plan_on_demand_neither_plans_nor_writes(
    inputs: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plans, out = tmp_path / "new-plans", tmp_path / "run"
    argv = ["launch", "--job", inputs[0], "--schedules", str(plans), "--plan-on-demand", "--out", str(out)]
    assert main([*argv, "--dry-run"]) == 0
    assert "[1, 1]: " in capsys.readouterr().out  # every worker's command line
    assert not plans.exists()


def test_check_data_stops_the_launch_when_the_data_function_drifts(
    inputs: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--check-data reads every micro-batch twice: a data function that is pure only in iterations 0
    and 1 passes the check before start, then stops the job in iteration 2 with its error (exit 2), instead
    of being re-routed from worker to worker."""
    extra = ["--entry", "tests.library_entries:drifting", "--check-data", "--iterations", "4"]
    assert main(launch(inputs, tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err
    assert "stopped with bad input with exit code 2" in err and "pure function" in err, err


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ("exhausted", r"data\(2, \d, \d\) raised IndexError: dataset exhausted"),
        ("shorter_from_iteration_2", r"stage 0's output of micro-batch \[\d, \d\] has shape"),
    ],
)
def test_an_error_in_the_users_code_mid_run_stops_the_launch_with_its_line(
    inputs: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: str, needle: str
) -> None:
    """Raised again on every peer it was re-routed to, it was taken for failures until a stage was
    lost ("no checkpoint"), the error only in a worker log; a shape that changed aborted the receiver
    in gloo. Now exit 2 with the worker's line (whichever worker meets it first: any micro-batch)."""
    extra = ["--entry", f"tests.library_entries:{entry}", "--iterations", "4"]
    assert main(launch(inputs, tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err
    assert "stopped with bad input with exit code 2" in err and re.search(needle, err), err
    assert "lost" not in err and "Traceback" not in err, err
