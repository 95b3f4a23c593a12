"""Restores and fencing with real worker processes (CPU, gloo), no launcher.

- A whole stage is killed (kill -9) under the real service: the fail event (posted with the job's
  worker token, as an agent does) makes the service restore at once; the survivors load the
  checkpoint in place (the same processes keep running), the killed workers are restarted by the
  test with `--resume-at K --restore-epoch 1` (what an agent does); parameters equal single-process
  training.
- Fencing, with a schedule file: a worker that was stopped (SIGSTOP, a partition) and finds itself
  listed alive since a later version (it was replaced meanwhile) exits 4 without taking part.
- The launcher's FilePublisher writes `joined_at` (and `restore_policy` with checkpoints) the way the
  service does, and a worker's fencing (FileScheduleSource, Incarnation) acts on it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime_adapter.assignment import Assignment, Worker
from runtime_adapter.client import FileScheduleSource
from runtime_adapter.incarnation import Incarnation, Verdict
from runtime_adapter.publishers import FilePublisher, publish
from tests.jobs import tiny_job
from tests.test_api_live import TOKEN, free_port, server
from tests.test_runtime_process import (
    CFG,
    assert_exactly_once,
    assert_matches_reference,
    assert_peers_identical,
    planner_schedules,
    records,
)
from tests.test_runtime_store import kill, start_store

pytestmark = pytest.mark.timeout(300)

CTL = {"Authorization": f"Bearer {TOKEN}"}
WORKER_ENV = {"RECYCLE_GROUP_TIMEOUT_S": "60", "RECYCLE_MAX_BACKOFF_S": "0.3", "RECYCLE_POLL_WAIT_S": "5"}
EVERYONE: list[Worker] = [(d, s) for d in range(2) for s in range(2)]


def worker_cmd(job_file: Path, w: Worker, source: list[str], store_port: int, out: Path, n: int,
               *extra: str) -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", "runtime_adapter.cli", "worker", "--job", str(job_file),
        "--pipeline", str(w[0]), "--stage", str(w[1]), *source, "--store", f"127.0.0.1:{store_port}",
        "--run-id", "restore-test", "--iterations", str(n), "--model", json.dumps(asdict(CFG)),
        "--out", str(out), *extra,
    ]  # fmt: skip


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, **WORKER_ENV)
    with log.open("ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def wait_until(done: Callable[[], bool], what: str, procs: dict[Any, subprocess.Popen[bytes]],
               timeout_s: float = 120) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}; exit codes {[p.poll() for p in procs.values()]}")
        time.sleep(0.05)


def steps(out: Path, w: Worker, version: int = 0) -> int:
    return sum(1 for r in records(out, w) if r["event"] == "step" and r["version"] >= version)


@pytest.fixture
def store() -> Iterator[int]:
    proc, port = start_store()
    yield port
    kill(proc)  # type: ignore[arg-type]


def test_whole_stage_lost_survivors_load_in_place_under_the_service(tmp_path: Path, store: int) -> None:
    job, n = tiny_job(2, 2), 16
    out, ckpt, port = tmp_path / "run", tmp_path / "ckpt", free_port()
    out.mkdir()
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    base = f"http://127.0.0.1:{port}"
    procs: dict[Worker, subprocess.Popen[bytes]] = {}
    with server(tmp_path / "data", port, RECYCLE_HEARTBEAT_CHECK_S="0.2") as svc, httpx.Client() as http:
        body = {"job": json.loads(job.model_dump_json()), "max_failures": 1, "heartbeat_enabled": False}
        r = http.post(f"{base}/v1/jobs", json=body, headers=CTL)
        assert r.status_code == 201, r.text
        job_id, token = r.json()["id"], r.json()["worker_token"]
        source = ["--service", base, "--job-id", job_id, "--token", token]
        ckpt_args = ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--pace-ms", "150")
        try:
            for w in EVERYONE:
                cmd = worker_cmd(job_file, w, source, store, out, n, *ckpt_args)
                procs[w] = start(cmd, out / f"worker_{w[0]}_{w[1]}.log")

            def restorable() -> int | None:
                doc = http.get(f"{base}/v1/jobs/{job_id}", headers=CTL).json()
                return doc["restorable_iteration"]  # type: ignore[no-any-return]

            # the workers report their checkpoints themselves (the `checkpoint` event)
            wait_until(lambda: (restorable() or 0) >= 2, "a checkpoint every stage reported", procs)
            lost = [(0, 1), (1, 1)]
            for w in lost:
                procs[w].kill()
                procs[w].wait(timeout=10)
            fail = {"event_id": "agent-test-fail", "kind": "fail", "workers": [list(w) for w in lost]}
            r = http.post(
                f"{base}/v1/jobs/{job_id}/events", json=fail, headers={"Authorization": f"Bearer {token}"}
            )
            assert r.status_code == 200, r.text
            answer = r.json()
            k, restore_version = answer["restore"]["iteration"], answer["version"]
            assert answer["restore"]["epoch"] == 1 and k >= 2 and answer["state"] == "running", answer
            survivors = {w: procs[w] for w in EVERYONE if w not in lost}
            for w in lost:  # what the agent does: restart the dead ones in the restore's epoch
                extra = (*ckpt_args, "--resume-at", str(k), "--restore-epoch", "1")
                procs[w] = start(
                    worker_cmd(job_file, w, source, store, out, n, *extra), out / f"worker_{w[0]}_{w[1]}.log"
                )
            codes = {w: p.wait(timeout=240) for w, p in procs.items()}
            doc = http.get(f"{base}/v1/jobs/{job_id}", headers=CTL).json()
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
        assert svc.poll() is None
    assert codes == {w: 0 for w in EVERYONE}, codes
    assert all(p is procs[w] for w, p in survivors.items())  # the same processes, never restarted
    assert doc["state"] == "finished" and doc["failed"] == [] and doc["restore"] == answer["restore"], doc
    for w in survivors:
        resumes = [r for r in records(out, w) if r["event"] == "resume"]
        assert resumes == [{"event": "resume", "stepped": k, "epoch": 1, "version": restore_version,
                            "in_place": True}], resumes  # fmt: skip
        assert steps(out, w, restore_version) == n - k
    for w in lost:
        assert [r["stepped"] for r in records(out, w) if r["event"] == "resume"] == [k]
        assert steps(out, w, restore_version) == n - k
    assert_exactly_once(out, job, n)
    assert_matches_reference(out, job, n, EVERYONE)
    assert_peers_identical(out, job)


def write_file(path: Path, version: int, schedule: Any, joined: dict[str, int]) -> None:
    publish(path, version, schedule, restore_policy="auto", joined_at=joined)


def test_a_worker_alive_in_a_later_incarnation_is_fenced(tmp_path: Path, store: int) -> None:
    """[1, 1] is stopped (SIGSTOP: no process dies, nothing is told) and replaced meanwhile: version 2
    lists it alive since v2. Continued, it must leave with exit 4 and write nothing of version 2; a fresh
    re-joiner takes its place and the job's parameters equal single-process training."""
    job, n, victim = tiny_job(2, 2), 30, (1, 1)
    out = tmp_path / "run"
    out.mkdir()
    job_file, sched = tmp_path / "job.json", tmp_path / "schedule.json"
    job_file.write_text(job.model_dump_json())
    schedule = planner_schedules(job)(frozenset())  # type: ignore[operator]
    write_file(sched, 1, schedule, {f"{d},{s}": 1 for d, s in EVERYONE})
    source = ["--schedule-file", str(sched)]
    procs = {w: start(worker_cmd(job_file, w, source, store, out, n, "--pace-ms", "200"),
                      out / f"worker_{w[0]}_{w[1]}.log") for w in EVERYONE}  # fmt: skip
    old = procs[victim]
    try:
        wait_until(lambda: all(steps(out, w) >= 2 for w in EVERYONE), "2 steps each", procs)
        os.kill(old.pid, signal.SIGSTOP)
        time.sleep(0.5)
        write_file(sched, 2, schedule, {f"{d},{s}": 2 if (d, s) == victim else 1 for d, s in EVERYONE})
        time.sleep(1.0)  # the survivors take v2 and wait in its rendezvous for [1, 1]
        acct = out / f"acct_{victim[0]}_{victim[1]}.jsonl"
        mark = acct.stat().st_size
        os.kill(old.pid, signal.SIGCONT)
        assert old.wait(timeout=60) == 4
        after = [json.loads(line) for line in acct.read_bytes()[mark:].decode().splitlines()]
        assert all(r.get("version", 1) < 2 for r in after), after  # nothing of version 2
        assert not any(r["event"] in ("version", "rejoin", "checkpoint", "done") for r in after), after
        log = (out / "worker_1_1.log").read_text()
        assert "declared failed and replaced meanwhile" in log and "Traceback" not in log
        rejoin = worker_cmd(job_file, victim, source, store, out, n, "--pace-ms", "200", "--rejoin")
        procs[victim] = start(rejoin, out / "worker_1_1.rejoin.log")
        codes = {w: p.wait(timeout=240) for w, p in procs.items()}
    finally:
        for p in [*procs.values(), old]:
            if p.poll() is None:
                p.kill()
    assert codes == {w: 0 for w in EVERYONE}, codes
    assert steps(out, victim, 2) >= 1
    assert_exactly_once(out, job, n)
    assert_matches_reference(out, job, n, EVERYONE)


def test_a_schedule_file_publishes_joined_at_and_the_worker_fences_by_it(tmp_path: Path) -> None:
    """FilePublisher's `joined_at`: 1 at the start, the re-join version for a re-joiner, the restore
    version for everyone after a restore; a stale process of a replaced worker is fenced by it."""
    job, victim = tiny_job(2, 2), (1, 1)
    path = tmp_path / "schedule.json"
    pub = FilePublisher(path, job, planner_schedules(job), checkpoints=tmp_path / "ckpt")  # type: ignore[arg-type]

    def envelope() -> dict[str, Any]:
        return json.loads(path.read_text())  # type: ignore[no-any-return]

    def view(w: Worker) -> Assignment:
        a = FileScheduleSource(path, w, job.num_pipelines, job.num_microbatches).fetch(0, timedelta(0))
        assert a is not None
        return a

    def joined(**changed: int) -> dict[str, int]:
        return {f"{d},{s}": v for d, s in EVERYONE if (v := changed.get(f"w{d}{s}", 1))}

    pub.start()
    assert envelope()["joined_at"] == joined() and envelope()["restore_policy"] == "auto"
    stale, peer = Incarnation(), Incarnation()
    for inc, w in ((stale, victim), (peer, (0, 1))):
        assert inc.judge(view(w)) is Verdict.RUN
        inc.took_part(view(w))
    assert (stale.joined, view(victim).joined_at) == (1, 1)

    pub.report("fail", [victim])  # v2: the failed worker is not listed
    assert envelope()["version"] == 2 and envelope()["joined_at"] == joined(w11=0)
    assert view(victim).joined_at is None and view((0, 1)).joined_at == 1
    pub.report("rejoin", [victim])  # v3: the re-joiner's incarnation starts here
    assert envelope()["joined_at"] == joined(w11=3)
    assert stale.judge(view(victim)) is Verdict.FENCED  # the old process (a healed partition) leaves
    fresh = Incarnation()
    assert fresh.judge(view(victim), fresh=True) is Verdict.RUN
    fresh.took_part(view(victim))
    assert fresh.joined == 3 and peer.judge(view((0, 1))) is Verdict.RUN  # the peer is untouched

    pub.report("fail", [(0, 1), victim])  # stage 1 lost: v4 is the restore version, everyone joins
    doc = envelope()
    assert doc["version"] == 4 and doc["restore"] == {"epoch": 1, "iteration": None}, doc
    assert doc["joined_at"] == {f"{d},{s}": 4 for d, s in EVERYONE} and doc["restore_policy"] == "auto"
    assert fresh.judge(view(victim)) is Verdict.RESTORE  # a newer epoch: not fenced, loads in place
    fresh.restored(view(victim))
    assert (fresh.epoch, fresh.joined) == (1, 4) and fresh.judge(view(victim)) is Verdict.RUN
    restarted = Incarnation(epoch=1)  # a worker restarted with --restore-epoch 1
    assert restarted.judge(view((0, 1))) is Verdict.RUN

    plain = FilePublisher(tmp_path / "plain.json", job, planner_schedules(job))  # type: ignore[arg-type]
    plain.start()  # without checkpoints it never restores by itself: no restore_policy
    doc = json.loads((tmp_path / "plain.json").read_text())
    assert "restore_policy" not in doc and doc["joined_at"] == joined()


def test_a_failure_set_without_a_plan_publishes_no_version(tmp_path: Path) -> None:
    """Before, the version was counted before the plan was looked up: the launcher printed
    "schedule now v3" and "last schedule v3" although schedule.json stayed at v2."""
    job = tiny_job(2, 2)
    planned = planner_schedules(job)

    def schedule_for(failed: frozenset[Worker]) -> Any:
        if len(failed) > 1:
            raise LookupError("no precomputed plan for this failure set")
        return planned(failed)  # type: ignore[operator]

    path = tmp_path / "schedule.json"
    pub = FilePublisher(path, job, schedule_for)
    pub.start()
    assert pub.report("fail", [(1, 1)]).version == 2
    with pytest.raises(LookupError):
        pub.report("fail", [(0, 0)])
    assert pub.version == 2 and json.loads(path.read_text())["version"] == 2
