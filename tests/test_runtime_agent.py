"""`recycle agent` (python -m runtime_adapter.agent_cli agent) against the real planner service
(uvicorn on 127.0.0.1) and a rendezvous store hosted by the test: bad input (one line, exit 2,
nothing left running), and two agents sharing one job, one of whose workers is killed -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest

from planner.contract import JobSpec
from tests.jobs import tiny_job
from tests.test_api_live import ROOT, TOKEN, free_port, server
from tests.test_runtime_process import CFG, assert_exactly_once, assert_matches_reference, records
from tests.test_runtime_service import SERVICE_ENV, stop

httpx = pytest.importorskip("httpx")

JOB = tiny_job(2, 2)
HEARTBEAT_S = 30.0  # far above the agent's report: a fail seen early was posted by the agent


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    with server(tmp_path_factory.mktemp("service"), port, **SERVICE_ENV) as proc:
        yield f"http://127.0.0.1:{port}"
        stop(proc)


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    import torch.distributed as dist

    server_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=30))  # fmt: skip
    yield f"127.0.0.1:{server_store.port}"
    del server_store


def register(service: str, job: JobSpec = JOB) -> tuple[str, str]:
    body = {"job": json.loads(job.model_dump_json()), "max_failures": 1, "heartbeat_timeout_s": HEARTBEAT_S}
    r = httpx.post(f"{service}/v1/jobs", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["worker_token"]


def job_status(service: str, job_id: str) -> dict:
    r = httpx.get(f"{service}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def agent_cmd(
    service: str, job_id: str, token: str, workers: str, store: str, out: Path, *extra: str
) -> list[str]:
    cmd = [sys.executable, "-m", "runtime_adapter.agent_cli", "agent", "--service", service,
           "--job-id", job_id, f"--token={token}", "--workers", workers, "--store", store,
           "--iterations", "4", "--out", str(out), "--model", json.dumps(asdict(CFG)), *extra]  # fmt: skip
    return cmd


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text` (workers of an agent's --out)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def run_agent(cmd: list[str], in_process: bool, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit code, stderr) of `cmd`: as a process, or through agent_cli.main here (the same checks,
    without a Python start and a torch import per case)."""
    if not in_process:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
        return done.returncode, done.stderr.strip()
    from runtime_adapter.agent_cli import main

    capsys.readouterr()
    code = main(cmd[3:])  # after `python -m runtime_adapter.agent_cli`
    return code, capsys.readouterr().err.strip()


@pytest.mark.timeout(240)
def test_bad_input_is_one_line_exit_2_and_nothing_runs(
    service: str, store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id, token = register(service)
    other_id, other_token = register(service)
    dead, nowhere = f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    split = "cannot be split into 2 stages"
    no_store = f"--store {dead}: no rendezvous store reachable"
    cases = [
        ("5,0", token, store, job_id, service, [], "worker [5, 0] is not in the job's 2 x 2 grid"),
        ("0,0;0", token, store, job_id, service, [], '--workers \'0,0;0\': expected "d,s;d,s"'),
        ("0,0;0,0", token, store, job_id, service, [], "is given twice"),
        ("0,0", "wrong-token", store, job_id, service, [], "refused it (HTTP 401)"),
        ("0,0", other_token, store, job_id, service, [], f"not a token of job {job_id} (HTTP 403)"),
        ("0,0", TOKEN, store, "no-such-job", service, [], "no such job"),
        ("0,0", token, store, job_id, nowhere, ["--wait", "0"], "not reachable as the planner service"),
        ("0,0", token, dead, job_id, service, ["--wait", "0"], no_store),
        ("0,0", token, dead, job_id, service, ["--wait", "1.5"], no_store),
        ("0,0", token, store, job_id, service, ["--wait", "-1"], "--wait must be at least 0"),
        ("0,0", token, store, job_id, service, ["--iterations", "0"], "--iterations must be at least 1"),
        ("0,0", token, store, job_id, service, ["--max-rejoins", "-1"], "--max-rejoins must be at least 0"),
        ("0,0", token, store, job_id, service, ["--pace-ms", "x"], "--pace-ms 'x': not a number"),
        ("0,0", token, store, job_id, service, ["--model", '{"num_layers": 1}'], split),
    ]  # fmt: skip
    assert other_id != job_id
    for i, (workers, tok, st, jid, svc, extra, message) in enumerate(cases):
        out = tmp_path / f"case{i}" / "out"
        out.parent.mkdir()
        cmd = agent_cmd(service, job_id, tok, workers, st, out, *extra)
        cmd[cmd.index("--service") + 1], cmd[cmd.index("--job-id") + 1] = svc, jid
        as_process = i == 0 or extra[:2] == ["--wait", "1.5"]  # the real entry point, twice
        code, err = run_agent(cmd, not as_process, capsys)
        assert code == 2, (workers, extra, code, err)
        if extra[:2] == ["--wait", "1.5"]:  # it waited (a progress line), then gave up
            waited, err = err.split("\n", 1)
            assert "waiting up to 1.5 s for the store" in waited, waited
        assert message in err and len(err.splitlines()) == 1, (message, err)
        assert "Traceback" not in err
        assert not list(out.glob("worker_*.pid")) and not processes_mentioning(str(out)), "a worker started"
    assert job_status(service, job_id)["version"] == 1  # nothing was posted


@pytest.mark.timeout(300)
def test_two_agents_share_a_job_and_report_a_kill_at_once(service: str, store: str, tmp_path: Path) -> None:
    """Agents "a" ([0, 0], [0, 1]) and "b" ([1, 0], [1, 1]) on one service job (heartbeat timeout
    30 s). [1, 1] is killed -9 after 3 steps: agent b posts `fail` with the id
    agent-b-fail-1.1-<pid> within seconds (the heartbeat would take 30), the survivors re-route
    without a restart and finish; both agents exit 0 once the job is finished; the survivors' final
    parameters equal single-process training and every micro-batch is counted once."""
    job_id, token = register(service)
    out, n, victim = tmp_path / "run", 30, (1, 1)
    out.mkdir()
    agents = {}
    for name, workers in (("a", "0,0;0,1"), ("b", "1,0;1,1")):
        cmd = agent_cmd(service, job_id, token, workers, store, out, "--agent-id", name, "--pace-ms", "150")
        cmd[cmd.index("--iterations") + 1] = str(n)
        log = (tmp_path / f"agent_{name}.log").open("w")
        agents[name] = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    everyone = [(d, s) for d in range(2) for s in range(2)]
    survivors = [w for w in everyone if w != victim]

    def steps(ws: list[tuple[int, int]]) -> int:
        return min(sum(1 for r in records(out, w) if r["event"] == "step") for w in ws)

    def agent_logs() -> str:
        return "\n".join(
            f"--- agent {k}:\n{(tmp_path / f'agent_{k}.log').read_text()[-3000:]}" for k in agents
        )

    try:
        deadline = time.monotonic() + 150
        while steps(everyone) < 3:
            assert all(p.poll() is None for p in agents.values()), agent_logs()
            assert time.monotonic() < deadline, "no 3 steps in 150 s\n" + agent_logs()
            time.sleep(0.1)
        pid = int((out / "worker_1_1.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while job_status(service, job_id)["failed"] != [list(victim)]:
            assert time.monotonic() - killed < 10, "the agent did not post the fail\n" + agent_logs()
            time.sleep(0.05)
        took = time.monotonic() - killed
        assert took < HEARTBEAT_S / 3, took
        page = httpx.get(f"{service}/jobs/{job_id}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert f"agent-b-fail-1.1-{pid}" in page.text, "the fail event has not the agent's id"
        codes = {k: p.wait(timeout=200) for k, p in agents.items()}
    finally:
        for p in agents.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert codes == {"a": 0, "b": 0}, (codes, agent_logs())
    assert not processes_mentioning(str(out)), "a worker outlived its agent"
    doc = job_status(service, job_id)
    assert doc["state"] == "finished" and doc["failed"] == [list(victim)], doc
    text = (tmp_path / "agent_b.log").read_text()
    assert "worker [1, 1] died" in text and "worker [1, 1]: exit -9" in text, text
    for w in survivors:  # never restarted: one process each, which finished
        assert sum(1 for r in records(out, w) if r["event"] == "done") == 1, w
    assert_exactly_once(out, JOB, n)
    assert_matches_reference(out, JOB, n, survivors)
