"""The rendezvous store as a process of its own (`recycle store`, runtime_adapter/store.py) and a
rendezvous that survives its death (rendezvous.connect_groups): bad input, rendezvous attempts (two members
in two threads, the store in a subprocess killed -9 and restarted), and a D=2 x P=2 job of real worker
processes on an external store that is killed -9 and restarted mid-run before a worker is killed."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import pytest
import torch.distributed as dist

from recycle_cli import main
from runtime_adapter import rendezvous
from runtime_adapter.assignment import Assignment, Worker
from runtime_adapter.comm import GroupReaper, allreduce_min
from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.rendezvous import attempt_key, connect_groups
from runtime_adapter.store import StoreClient
from tests.jobs import tiny_job
from tests.test_runtime_process import (
    CFG,
    assert_exactly_once,
    assert_matches_reference,
    assert_peers_identical,
    planner_schedules,
    records,
)
from tests.test_runtime_service import supervise_until

TIMEOUT = timedelta(seconds=20)
STORE = [sys.executable, "-m", "recycle_cli", "store", "--host", "127.0.0.1"]  # = `recycle store`


def start_store(port: int = 0) -> tuple[subprocess.Popen[str], int]:
    """`recycle store` on 127.0.0.1:`port` (0: a free one); the process and its port. Its stderr goes
    to a file (`errors(proc)`): a pipe nobody reads could fill up and block it."""
    err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (open as long as the store runs)
    proc = subprocess.Popen([*STORE, "--port", str(port)], stdout=subprocess.PIPE, stderr=err, text=True)
    STDERR[proc.pid] = err
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith("store listening on 127.0.0.1:"), (line, errors(proc))
    return proc, int(line.rsplit(":", 1)[1])


STDERR: dict[int, IO[str]] = {}


def errors(proc: subprocess.Popen[str]) -> str:
    """What a store started by `start_store` wrote to stderr so far."""
    err = STDERR[proc.pid]
    err.seek(0)
    return err.read()


def kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def store() -> Iterator[list[Any]]:
    """A `recycle store` as [process, port]; a test may replace the process (restart); killed at the end."""
    proc, port = start_store()
    box: list[Any] = [proc, port]
    yield box
    kill(box[0])


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


# `recycle store` and `recycle launch --store`: bad input


@pytest.mark.timeout(30)
def test_store_prints_its_address_and_stops_cleanly_on_sigterm() -> None:
    proc, port = start_store()
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    client.set("k", "v")
    assert client.get("k") == b"v"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert "Traceback" not in errors(proc)


@pytest.mark.timeout(30)
def test_store_bad_input_is_one_line_and_exit_2(store: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "--port", "70000"]) == 2
    assert "port 70000: expected 0 (any free port) or 1..65535" in one_line(capsys.readouterr().err)
    taken = subprocess.run([*STORE, "--port", str(store[1])], capture_output=True, text=True, timeout=20)
    assert taken.returncode == 2 and taken.stdout == ""
    assert f"cannot listen on 127.0.0.1:{store[1]}" in one_line(taken.stderr), taken.stderr
    assert store[0].poll() is None  # the first one still serves


@pytest.mark.timeout(60)
def test_launch_store_unreachable_or_with_store_port_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--store at an address nothing listens on: one line, exit 2, nothing started (no --out written);
    --store with --store-port: the same."""
    job = tmp_path / "job.json"
    job.write_text(tiny_job(2, 2).model_dump_json())
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["launch", "--job", str(job), "--schedules", str(tmp_path / "plans"), "--plan-on-demand",
            "--out", str(tmp_path / "run"), "--store", f"127.0.0.1:{port}"]  # fmt: skip
    t0 = time.monotonic()
    assert main(argv) == 2
    err = one_line(capsys.readouterr().err)
    assert f"--store 127.0.0.1:{port}: no rendezvous store reachable there" in err and "recycle store" in err
    assert time.monotonic() - t0 < 20
    assert not (tmp_path / "run").exists() and not (tmp_path / "plans").exists()
    assert main([*argv, "--store-port", "0"]) == 2
    assert "--store and --store-port exclude each other" in one_line(capsys.readouterr().err)
    assert main([*argv[:-1], "127.0.0.1"]) == 2  # no port
    assert "expected HOST:PORT" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


# rendezvous attempts: two members ([0, 0] and [1, 0] of a 2 x 1 job) in two threads


def peer(d: int, version: int) -> Assignment:
    return Assignment(version, (d, 0), 2, 1, 1, frozenset(), (), stage_alive=((0, 0), (1, 0)))


def connect_in_threads(port: int, version: int, reaper: GroupReaper, delays: tuple[float, float] = (0, 0),
                       between: Callable[[], None] | None = None, run_id: str = "",
                       timeout: timedelta = TIMEOUT,
                       patience: timedelta | None = None) -> list[Any]:  # fmt: skip
    """connect_groups for both members (member 1 starts `delays[1]` s later, after `between()`); their
    groups and the result of an all-reduce over them."""
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(d: int) -> None:
        try:
            g = connect_groups(("127.0.0.1", port), peer(d, version), threading.Event(), "gloo", timeout,
                               reaper, lambda: False, run=run_id, patience=patience)  # fmt: skip
            results[d] = (g, allreduce_min(g, [10 + d]), allreduce_min(g, [5 - d], on_stage=True))
        except BaseException as e:
            errors.append(e)

    first = threading.Thread(target=run, args=(0,))
    first.start()
    time.sleep(delays[1])
    if between is not None:
        between()
    second = threading.Thread(target=run, args=(1,))
    second.start()
    for t in (first, second):
        t.join(40)
    assert not errors, errors
    assert [r[1:] for r in results] == [([10], [4])] * 2
    return [r[0] for r in results]


def token_on(port: int, version: int, root: str = "recycle") -> str | None:
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    key = attempt_key(version, root)
    return client.get(key).decode() if client.check([key]) else None


@pytest.mark.timeout(60)
def test_two_runs_on_one_long_lived_store_never_meet(store: list[Any]) -> None:
    """A second job (or a relaunch) on a store that outlived the first one builds its version-1 groups
    at once: its keys live under recycle/<run id>/, so the first run's token and gloo addresses for
    v1 (whose groups are gone) are never read."""
    reaper = GroupReaper()
    for run in ("first-run", "second-run"):
        t0 = time.monotonic()
        for g in connect_in_threads(store[1], 1, reaper, run_id=run):
            reaper.retire(g)
        assert reaper.drain(30) and time.monotonic() - t0 < 10, run
    client = dist.TCPStore("127.0.0.1", store[1], is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    keys = [attempt_key(1, f"recycle/{run}") for run in ("first-run", "second-run")] + [attempt_key(1)]
    assert [client.check([k]) for k in keys] == [True, True, False]  # two tokens, none shared


@pytest.mark.timeout(60)
def test_a_rendezvous_interrupted_by_the_store_death_starts_again_on_the_restarted_store(
    store: list[Any],
) -> None:
    """Member 0 is waiting for member 1 in v5's rendezvous when the store is killed -9; an empty store
    restarts on the same port 1 s later; member 1 arrives then. Both build v5's groups on the new store
    under a new attempt token; the groups work."""
    reaper = GroupReaper()
    old: list[str | None] = []

    def restart() -> None:
        old.append(token_on(store[1], 5))
        kill(store[0])
        time.sleep(1.0)  # member 0's connect retries meanwhile
        store[0] = start_store(store[1])[0]

    groups = connect_in_threads(store[1], 5, reaper, (0, 1.0), restart)
    new = token_on(store[1], 5)
    assert old[0] is not None and new is not None and new != old[0]
    for g in groups:
        reaper.retire(g)
    assert reaper.drain(20)


@pytest.mark.timeout(60)
def test_a_member_later_than_the_group_timeout_joins_a_new_attempt(store: list[Any]) -> None:
    """Member 1 (a re-joiner still importing torch on a loaded host) arrives 5 s after member 0, whose
    builds time out after 2 s. Member 0 retires its attempts and starts new ones until its patience
    (20 s) is spent; member 1 joins the current one and both build v9's groups (with the patience
    equal to the timeout, member 0 gave up after 2 s and the worker waited for a version that no one
    would publish)."""
    reaper = GroupReaper()
    t0 = time.monotonic()
    short, patience = timedelta(seconds=2), timedelta(seconds=20)
    groups = connect_in_threads(store[1], 9, reaper, (0, 5.0), timeout=short, patience=patience)
    assert time.monotonic() - t0 < 15
    for g in groups:
        reaper.retire(g)
    assert reaper.drain(20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leak", [False, True], ids=["dropped", "kept-open"])
def test_members_that_built_a_failed_attempt_start_again_with_the_others(
    store: list[Any], monkeypatch: pytest.MonkeyPatch, leak: bool
) -> None:
    """The store dies after member 0 built both groups, before member 1 saw its last key (simulated: member
    1's first build raises after connecting). Member 1 retires the attempt; member 0 learns it from its
    commit all-reduce failing (member 1 dropped its half-built groups) or, if member 1 keeps them open,
    from the attempt key on the store. Both end with groups of a second attempt."""
    real, kept, calls = rendezvous.build_groups, [], Counter[Worker]()

    def flaky(store: Any, a: Assignment, *args: Any, **kwargs: Any) -> Any:
        calls[a.worker] += 1
        groups = real(store, a, *args, **kwargs)
        if a.worker == (1, 0) and calls[a.worker] == 1:
            if leak:
                kept.append(groups)
            raise dist.DistNetworkError("simulated: the store died before this member finished")
        return groups

    monkeypatch.setattr(rendezvous, "build_groups", flaky)
    reaper = GroupReaper()
    t0 = time.monotonic()
    groups = connect_in_threads(store[1], 7, reaper)
    assert calls == {(0, 0): 2, (1, 0): 2} and time.monotonic() - t0 < 10
    kept.clear()  # member 0's commit on the failed attempt then fails: its groups can be destroyed
    for g in groups:
        reaper.retire(g)
    assert reaper.drain(20)


@pytest.mark.timeout(30)
def test_the_launchers_client_reconnects_after_a_store_restart(store: list[Any]) -> None:
    client = StoreClient(("127.0.0.1", store[1]), TIMEOUT)
    client.set("a", "1")
    kill(store[0])
    store[0] = start_store(store[1])[0]
    client.set("b", "2")  # on the restarted store
    reader = dist.TCPStore("127.0.0.1", store[1], is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    assert reader.get("b") == b"2" and not reader.check(["a"])


# a real job on an external store that dies


def step_records(out: Path, w: Worker) -> list[dict[str, Any]]:
    return [r for r in records(out, w) if r["event"] == "step"]


@pytest.mark.timeout(120)
def test_kill_the_store_mid_run_restart_it_then_kill_a_worker(store: list[Any], tmp_path: Path) -> None:
    """D=2 x P=2 on a `recycle store`: the store is killed -9 after 2 steps, training goes on without
    it, an empty store restarts on the same port, then worker [1, 1] is killed -9: the survivors build
    v2's groups on the new store and finish; a warm standby that was waiting on the dead store
    reconnects and re-joins under v3 (the launcher's client reconnected too). Final parameters equal
    single-process training, every micro-batch counted once, and the survivors replayed at most one
    iteration per version change (none for the store's death)."""
    # 80 paced iterations: the run must outlast the store's restart (a Python start and a torch
    # import, slower with the tests in two processes)
    job, n, victim, out = tiny_job(2, 2), 80, (1, 1), tmp_path / "run"
    spec = LaunchSpec(job, asdict(CFG), n, out, pace_ms=250, store=("127.0.0.1", store[1]))
    launcher = Launcher(spec, planner_schedules(job))  # type: ignore[arg-type]
    everyone, survivors = spec.workers(), [w for w in spec.workers() if w != victim]
    launcher.start()

    def steps(workers: list[Worker] = everyone, version: int = 0) -> int:
        return min(sum(1 for r in step_records(out, w) if r["version"] >= version) for w in workers)

    launcher.add_standby(victim)  # waits on the store, which dies under it: it must reconnect
    supervise_until(launcher, lambda: steps() >= 2, "2 steps")
    standby_log = out / "worker_1_1_standby1.log"

    def standby_says(text: str) -> bool:
        return standby_log.exists() and text in standby_log.read_text(errors="replace")

    supervise_until(
        launcher, lambda: standby_says("standby: waiting for"), "the standby waiting on the store"
    )
    kill(store[0])
    down = steps()
    supervise_until(launcher, lambda: steps() >= down + 2, "2 steps with the store down")
    store[0] = start_store(store[1])[0]
    root = f"recycle/{spec.run_id}"  # the launcher's namespace of store keys
    assert token_on(store[1], 1, root) is None  # an empty store: v1's rendezvous was on the dead one
    assert steps() < n - 16, "the run is nearly over: pace it slower"
    launcher.kill(victim)
    supervise_until(launcher, lambda: victim in launcher.failed and launcher.version == 2, "the failure")
    supervise_until(launcher, lambda: steps(survivors, 2) >= 1, "survivors stepping under v2")
    assert token_on(store[1], 2, root) is not None  # v2's groups were built on the restarted store
    launcher.activate(victim)
    assert launcher.version == 3
    codes = launcher.wait(timedelta(seconds=90))
    assert all(rc == 0 for rc in codes.values()), codes
    assert steps([victim], 3) >= 1  # the standby trained under the rejoin version
    assert standby_says("the store went away"), "the standby never lost its store: nothing was tested"
    for w in survivors:  # never restarted; versions only grow; the store's death replayed nothing
        recs = records(out, w)
        assert sum(1 for r in recs if r["event"] == "done") == 1
        versions = [r["version"] for r in recs if r["event"] == "step"]
        assert versions == sorted(versions) and set(versions) <= {1, 2, 3}, versions
        v1 = [r["it"] for r in step_records(out, w) if r["version"] == 1]
        assert v1 == list(range(len(v1))), v1
        twice = [it for it, c in Counter(r["it"] for r in step_records(out, w)).items() if c > 1]
        assert len(twice) <= 2, (w, twice)  # at most one per version change (the failure, the re-join)
    assert_exactly_once(out, job, n)
    assert_matches_reference(out, job, n, everyone)
    assert_peers_identical(out, job)
