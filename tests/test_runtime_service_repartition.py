"""Layer migration planned by the real planner service (issue 12): a job registered with
`repartition: true`, workers polling their views over HTTP, kill -9, re-join.

The reference GPT as D=2 x P=2 (4 blocks: [0, 2) and [2, 4)), CPU and gloo. Worker [1, 0] is
SIGKILLed once [0, 0] stepped twice; the launcher posts `fail`; the service's next version re-partitions
(block 1 moves from stage 0, which kept one worker, to stage 1: [0, 1) / [1, 4)) and every survivor's
view carries it; the survivors migrate and train on. [1, 0] re-joins from a warm standby once each
of them stepped twice since it migrated; the failure-free plan has the job's own split, so block 1
moves back. Losses and final parameters equal single-process training (relative error < 1e-5), every
micro-batch counted once. Plus `recycle launch --repartition`'s checks before start (one line, exit 2).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from runtime_adapter.assignment import Worker
from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.migration_job import with_derived_layers
from runtime_adapter.model import training
from runtime_adapter.publishers import ServicePublisher
from tests.jobs import tiny_job
from tests.test_api_live import TOKEN, free_port, server
from tests.test_runtime_process import (
    CFG,
    assert_exactly_once,
    assert_losses_match,
    assert_matches_reference,
    records,
)
from tests.test_runtime_service import SERVICE_ENV, stop

VICTIM: Worker = (1, 0)
SURVIVORS: list[Worker] = [(0, 0), (0, 1), (1, 1)]


def migrations(out: Path, w: Worker) -> list[tuple[int, list[int], list[int]]]:
    return [(r["version"], r["from"], r["to"]) for r in records(out, w) if r["event"] == "migration"]


def steps(out: Path, w: Worker, since_version: int) -> int:
    return sum(1 for r in records(out, w) if r["event"] == "step" and r["version"] >= since_version)


@pytest.mark.timeout(180)
def test_service_moves_layers_off_a_short_stage_and_back(tmp_path: Path) -> None:
    job = with_derived_layers(tiny_job(2, 2, 2), training(**asdict(CFG)), optimizer_copies=1, mib_per_ms=1.0)
    n, out, port = 16, tmp_path / "run", free_port()
    pub = ServicePublisher(
        f"http://127.0.0.1:{port}", TOKEN, job, max_failures=0, heartbeat_enabled=False, repartition=True
    )
    spec = LaunchSpec(job, asdict(CFG), n, out, pace_ms=60)
    launcher = Launcher(spec, publisher=pub)
    marks: dict[str, int] = {}

    def trained_moved(w: Worker) -> bool:  # two steps since w migrated (a stage-1 worker steps later)
        moved = migrations(out, w)
        return bool(moved) and steps(out, w, moved[0][0]) >= 2

    def on_tick(lr: Launcher) -> None:
        if "killed" not in marks and steps(out, (0, 0), 1) >= 2:
            lr.kill(VICTIM)  # kill -9
            marks["killed"] = 1
        elif "fail" not in marks and VICTIM in lr.failed and pub.version >= 2:
            marks["fail"] = pub.version
        elif "rejoin" not in marks and "fail" in marks and all(trained_moved(w) for w in SURVIVORS):
            lr.activate(VICTIM)
            marks["rejoin"] = pub.version

    with server(tmp_path / "data", port, **SERVICE_ENV) as proc:
        launcher.start()
        launcher.add_standby(VICTIM)
        codes = launcher.wait(timedelta(seconds=150), on_tick)
        status = pub.status()
        stop(proc)
    assert codes == {(0, 0): 0, (0, 1): 0, VICTIM: 0, (1, 1): 0}, codes
    assert status["repartition"] is True and status["state"] == "finished", status
    assert marks["rejoin"] > marks["fail"] >= 2, marks
    fail_v, back_v = marks["fail"], marks["rejoin"]
    # (the fail's version, or its CP-SAT refinement if that came first: the same split)
    for w, there, home in [((0, 0), [0, 1], [0, 2]), ((0, 1), [1, 4], [2, 4]), ((1, 1), [1, 4], [2, 4])]:
        (v1, a1, b1), (v2, a2, b2) = migrations(out, w)
        assert (a1, b1, a2, b2) == (home, there, there, home), (w, migrations(out, w))
        assert fail_v <= v1 < back_v <= v2, (w, migrations(out, w), marks)
    moved = migrations(out, (1, 1))[0][0]
    assert steps(out, (1, 1), moved) - steps(out, (1, 1), back_v) >= 2  # trained on the moved split
    job_plain = tiny_job(2, 2, 2)
    assert_exactly_once(out, job_plain, n)
    assert_losses_match(out, job_plain, n)
    assert_matches_reference(out, job_plain, n, [(0, 0), (0, 1), VICTIM, (1, 1)])


def launch(tmp_path: Path, job: dict[str, Any], *extra: str) -> tuple[int, str]:
    from recycle_cli import main

    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    argv = ["launch", "--job", str(path), "--out", str(tmp_path / "out"), "--dry-run", *extra]
    try:
        return main(argv), ""
    except SystemExit as exc:
        return int(exc.code or 0), ""


def test_launch_repartition_is_checked_before_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RECYCLE_CONTROLLER_TOKEN", TOKEN)
    plain = tiny_job(2, 2, 2).model_dump(mode="json", exclude_none=True)
    layered = {**plain, "model": {"layers": 4}}
    url = "http://127.0.0.1:9"  # a dry run contacts nobody
    assert launch(tmp_path, layered, "--service", url, "--repartition")[0] == 0
    assert "with re-partition" in capsys.readouterr().out
    cases = [
        (plain, ["--service", url, "--repartition"], "--repartition: --job"),
        (layered, ["--schedules", str(tmp_path), "--repartition"], "--repartition goes with --service"),
    ]
    for doc, flags, message in cases:
        code, _ = launch(tmp_path, doc, *flags)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], (code, err)
