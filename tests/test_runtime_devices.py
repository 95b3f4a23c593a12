"""Devices and backends (runtime_adapter/devices.py), the wire device of the process groups, and the
NCCL-only paths of comm.py tested without NCCL: the polling waiter and the abort of retired groups
(duck-typed groups and works), the NCCL environment. `gpu` tests need CUDA (skipped here)."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from planner.errors import InvalidInputError
from runtime_adapter import comm, nccl
from runtime_adapter.assignment import Assignment
from runtime_adapter.comm import (
    DONE_WAIT,
    GroupReaper,
    Groups,
    Interrupted,
    Waiter,
    allreduce_min,
    broadcast_bytes,
    build_groups,
)
from runtime_adapter.devices import choose_backend, resolve_device, wire_device
from runtime_adapter.rendezvous import connect_groups

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")
TIMEOUT = timedelta(seconds=10)


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, nccl_built: bool = True) -> None:
    """Pretend this machine has `count` CUDA devices (only what devices.py asks torch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl_built)


def one_line_error(call: Callable[[], object], *fragments: str) -> str:
    with pytest.raises(InvalidInputError) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and msg, msg
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


# resolve_device


def test_cpu_and_auto_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 0)
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto") == CPU
    assert resolve_device("auto", 3) == CPU


def test_cuda_requested_without_cuda_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 0)
    msg = one_line_error(lambda: resolve_device("cuda"))
    assert msg == "--device cuda: no CUDA device here (torch.cuda.is_available() is false)"
    one_line_error(lambda: resolve_device("cuda:0"), "--device cuda:0", "no CUDA device here")
    one_line_error(lambda: resolve_device("cuda", 1), "no CUDA device here")


def test_cuda_picks_the_local_index_modulo_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda", 1) == torch.device("cuda", 1)
    assert resolve_device("cuda", 3) == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda", 2) == torch.device("cuda", 0)  # an explicit index wins
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_bad_local_rank_and_index_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "x")
    one_line_error(lambda: resolve_device("cuda"), "LOCAL_RANK='x'")
    one_line_error(lambda: resolve_device("cuda", -1), "negative")
    msg = one_line_error(lambda: resolve_device("cuda:2"), "--device cuda:2", "index out of range")
    assert "2 CUDA device(s)" in msg


@pytest.mark.parametrize("spec", ["gpu", "CPU", "", "cuda:", "cuda:x", "cuda:-1", "mps", "cuda:1\nx"])
def test_unknown_device_strings_are_one_line(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    fake_gpus(monkeypatch, 2)
    one_line_error(lambda: resolve_device(spec), "unknown device", "expected cpu, cuda, cuda:N or auto")


# choose_backend


def test_gloo_is_always_taken_as_asked() -> None:
    assert choose_backend("gloo", CPU, 4) == ("gloo", None)
    assert choose_backend("gloo", torch.device("cuda", 0), 1) == ("gloo", None)


def test_nccl_with_one_worker_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    assert choose_backend("nccl", torch.device("cuda", 1), 1) == ("nccl", None)


def test_nccl_falls_back_to_gloo_when_workers_share_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 1)
    backend, why = choose_backend("nccl", torch.device("cuda", 0), 4)
    assert backend == "gloo" and why is not None and "4 workers share" in why and "\n" not in why


def test_auto_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    assert choose_backend("auto", torch.device("cuda", 0), 1)[0] == "nccl"
    backend, why = choose_backend("auto", torch.device("cuda", 0), 2)
    assert backend == "gloo" and why and "2 workers share" in why
    backend, why = choose_backend("auto", CPU, 1)
    assert backend == "gloo" and why and "no CUDA" in why
    fake_gpus(monkeypatch, 2, nccl_built=False)
    backend, why = choose_backend("auto", torch.device("cuda", 0), 1)
    assert backend == "gloo" and why and "no NCCL" in why


def test_backend_errors_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 1)
    one_line_error(lambda: choose_backend("mpi", CPU, 1), "--backend 'mpi'", "unknown backend")
    one_line_error(lambda: choose_backend("nccl", CPU, 1), "--backend nccl needs a CUDA device", "cpu")
    one_line_error(lambda: choose_backend("gloo", CPU, 0), "at least 1")
    fake_gpus(monkeypatch, 1, nccl_built=False)
    one_line_error(lambda: choose_backend("nccl", torch.device("cuda", 0), 1), "no NCCL")


# wire_device


def test_wire_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    assert wire_device("gloo", CPU) == CPU
    assert wire_device("gloo", torch.device("cuda", 1)) == CPU  # gloo moves CPU tensors
    assert wire_device("nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert wire_device("nccl", torch.device("cuda")) == torch.device("cuda", 0)
    one_line_error(lambda: wire_device("nccl", CPU), "needs a CUDA device")
    one_line_error(lambda: wire_device("auto", CPU), "'auto'", "choose_backend")
    one_line_error(lambda: wire_device("mpi", CPU), "'mpi'")


# groups on the CPU wire device (gloo, two ranks in two threads)


def peer(d: int, version: int = 1) -> Assignment:
    """Worker [d, 0] of a 2 x 1 job: both workers are in the world and in the stage group."""
    return Assignment(version, (d, 0), 2, 1, 1, frozenset(), (), stage_alive=((0, 0), (1, 0)))


def on_both(fn: Callable[[int], Any]) -> list[Any]:
    """Run fn(0) and fn(1) in two threads (each blocks until the other joins); their results."""
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(d: int) -> None:
        try:
            results[d] = fn(d)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


def exchange(groups: Groups, d: int) -> tuple[list[int], bytes]:
    low = allreduce_min(groups, [10 + d, 7 - d])
    on_stage = allreduce_min(groups, [5 - d], on_stage=True)
    data = broadcast_bytes(groups, b"state of [0, 0]" if d == 0 else None, 0)
    return low + on_stage, data


def test_gloo_groups_on_the_cpu_wire_device() -> None:
    store, stop = dist.HashStore(), threading.Event()
    built = on_both(lambda d: build_groups(store, peer(d), stop, "gloo", TIMEOUT, device=CPU))
    assert all(g.device == CPU and g.backend == "gloo" and not g.waiter.polls for g in built)
    assert all(g.waiter.errored() is None for g in built)
    results = on_both(lambda d: exchange(built[d], d))
    assert results == [([10, 6, 4], b"state of [0, 0]")] * 2
    for g in built:
        g.close()


def test_connect_groups_takes_the_wire_device() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    reaper, stop = GroupReaper(), threading.Event()
    built = on_both(
        lambda d: connect_groups(
            ("127.0.0.1", master.port), peer(d, 3), stop, "gloo", TIMEOUT, reaper, lambda: False, device=CPU
        )
    )
    assert [g.device for g in built] == [CPU, CPU] and reaper.live() == 4
    assert on_both(lambda d: exchange(built[d], d)) == [([10, 6, 4], b"state of [0, 0]")] * 2
    for g in built:
        reaper.retire(g)
    assert reaper.drain(20) and reaper.live() == 0


# the NCCL waiter: polls is_completed() (fake works, no NCCL)


class FakeWork:
    """An NCCL-like work: `is_completed()` turns true when `done` is set; `wait` raises `error`."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.done, self.error = threading.Event(), error
        self.waits: list[timedelta | None] = []

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        assert self.done.is_set(), "wait() before is_completed(): would block or not raise"
        self.waits.append(timeout)
        if self.error is not None:
            raise self.error
        return True


def later(seconds: float, fn: Callable[[], object]) -> threading.Timer:
    t = threading.Timer(seconds, fn)
    t.start()
    return t


def test_the_nccl_waiter_polls_until_completed() -> None:
    waiter, work = Waiter(threading.Event(), "nccl"), FakeWork()
    assert waiter.polls
    later(0.05, work.done.set)
    t0 = time.monotonic()
    waiter.wait(work, "recv")
    assert 0.04 < time.monotonic() - t0 < 1.0
    assert work.waits == [DONE_WAIT]  # a wait with a timeout: WorkNCCL rethrows the work's error
    waiter.close()


def test_the_nccl_waiter_gives_up_when_interrupted() -> None:
    interrupted = threading.Event()
    waiter, work = Waiter(interrupted, "nccl"), FakeWork()
    later(0.05, interrupted.set)
    t0 = time.monotonic()
    with pytest.raises(Interrupted, match="recv of mb 3"):
        waiter.wait(work, "recv of mb 3")
    assert time.monotonic() - t0 < 1.0 and work.waits == []
    waiter.close()


def test_the_nccl_waiter_raises_the_works_error() -> None:
    waiter, work = Waiter(threading.Event(), "nccl"), FakeWork(RuntimeError("NCCL timeout"))
    work.done.set()
    with pytest.raises(RuntimeError, match="NCCL timeout"):
        waiter.wait(work, "all-reduce")
    waiter.close()


def test_the_nccl_waiter_raises_a_group_error_without_waiting_for_completion() -> None:
    """A timeout seen by the watchdog (get_error() != SUCCESS) fails the wait at once: after the
    watchdog's abort the work would look completed, with garbage in its tensors."""
    waiter, work = Waiter(threading.Event(), "nccl"), FakeWork()
    errors: list[str | None] = [None]
    waiter.errored = lambda: errors[0]
    later(0.05, lambda: errors.__setitem__(0, "world group: TIMEOUT"))
    with pytest.raises(dist.DistBackendError, match="recv: NCCL world group: TIMEOUT"):
        waiter.wait(work, "recv")
    work.done.set()  # completed, but the group failed: still an error
    with pytest.raises(dist.DistBackendError):
        waiter.wait(work, "recv")
    assert work.waits == []
    waiter.close()


class ErrorState:
    def __init__(self, name: str) -> None:
        self.name = name


class Probed:
    def __init__(self, state: str = "SUCCESS") -> None:
        self.state = state

    def get_error(self) -> ErrorState:
        return ErrorState(self.state)


def test_error_probe_reports_the_first_failed_group_and_holds_no_reference() -> None:
    world, stage = Probed(), Probed()
    probe = nccl.error_probe((world, stage))
    assert probe() is None
    stage.state = "COMM_ERROR"
    assert probe() == "stage group: COMM_ERROR"
    world.state = "TIMEOUT"
    assert probe() == "world group: TIMEOUT"
    gone = weakref.ref(world)
    del world
    assert gone() is None and probe() == "world group: destroyed"


# the reaper aborts retired NCCL groups before dropping them (duck-typed groups, no NCCL)


class FakeNcclGroup:
    """Records abort() (and the NCCL group calls around it) into a shared event list."""

    def __init__(self, name: str, events: list[str], fail: bool = False) -> None:
        self.name, self.events, self.fail = name, events, fail

    def abort(self) -> None:
        self.events.append(f"abort {self.name}")
        if self.fail:
            raise RuntimeError("abort failed")

    def _group_start(self) -> None:
        self.events.append("group start")

    def _group_end(self) -> None:
        self.events.append("group end")


def fake_groups(backend: str, events: list[str], fail: bool = False, version: int = 1) -> Groups:
    world, stage = FakeNcclGroup("world", events, fail), FakeNcclGroup("stage", events, fail)
    for pg in (world, stage):
        weakref.finalize(pg, events.append, f"destroyed {pg.name}")
    ranks = {(0, 0): 0}
    waiter = Waiter(threading.Event(), backend)
    return Groups(version, world, ranks, stage, ranks, waiter, CPU, backend)


def test_the_reaper_aborts_retired_nccl_groups_before_dropping_them() -> None:
    events: list[str] = []
    reaper = GroupReaper()
    reaper.retire(reaper.track(fake_groups("nccl", events)))
    assert reaper.drain(10) and reaper.live() == 0
    # only the stage group runs on NCCL: the world group (point-to-point) is always gloo
    assert events[:3] == ["group start", "abort stage", "group end"]
    assert sorted(events[3:]) == ["destroyed stage", "destroyed world"]


def test_the_reaper_survives_a_failing_abort() -> None:
    events: list[str] = []
    reaper = GroupReaper()
    reaper.retire(reaper.track(fake_groups("nccl", events, fail=True)))
    assert reaper.drain(10) and reaper.live() == 0
    assert events[:3] == ["group start", "abort stage", "group end"]
    reaper.retire(reaper.track(fake_groups("nccl", events, version=2)))  # still running
    assert reaper.drain(10) and reaper.live() == 0


def test_the_reaper_never_aborts_gloo_groups() -> None:
    events: list[str] = []
    reaper = GroupReaper()
    reaper.retire(reaper.track(fake_groups("gloo", events)))
    assert reaper.drain(10) and reaper.live() == 0
    assert sorted(events) == ["destroyed stage", "destroyed world"]


def test_abort_groups_aborts_one_group_once_and_works_without_group_calls() -> None:
    events: list[str] = []
    pg = FakeNcclGroup("world", events)
    nccl.abort_groups([pg, pg, None])
    assert events == ["group start", "abort world", "group end"]

    class Bare:
        def __init__(self) -> None:
            self.aborted = 0

        def abort(self) -> None:
            self.aborted += 1

    a, b = Bare(), Bare()
    nccl.abort_groups([a, b])
    assert (a.aborted, b.aborted) == (1, 1)


def test_abort_groups_aborts_even_when_the_group_call_fails() -> None:
    events: list[str] = []

    class NoGroup(FakeNcclGroup):
        def _group_start(self) -> None:
            raise RuntimeError("no NCCL group here")

    nccl.abort_groups([NoGroup("world", events), FakeNcclGroup("stage", events)])
    assert events == ["abort world", "abort stage"]


# the NCCL environment


def test_nccl_environment_is_set_once_and_keeps_the_users_values(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in [*nccl.ENV, nccl.NONBLOCKING_TIMEOUT]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(nccl, "_env_done", False)
    nccl.configure_env(timedelta(seconds=20))
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: no teardown
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "20"
    nccl.configure_env(timedelta(seconds=99))  # once per process
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "20"

    monkeypatch.setattr(nccl, "_env_done", False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    with caplog.at_level(logging.WARNING, logger="runtime_adapter.nccl"):
        nccl.configure_env(timedelta(seconds=20))
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in caplog.text


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch build has NCCL")
def test_nccl_group_on_a_build_without_nccl_fails_clearly() -> None:
    with pytest.raises(RuntimeError, match="no NCCL"):
        comm.make_group(dist.HashStore(), 0, 1, "nccl", TIMEOUT, torch.device("cuda", 0))


# real NCCL (skipped without CUDA)


@pytest.mark.gpu
def test_nccl_group_of_one_rank_on_cuda0() -> None:
    device = torch.device("cuda", 0)
    reaper, stop = GroupReaper(), threading.Event()
    a = Assignment(1, (0, 0), 1, 1, 1, frozenset(), (), stage_alive=((0, 0),))
    groups = reaper.track(build_groups(dist.HashStore(), a, stop, "nccl", TIMEOUT, device=device))
    # the stage group is NCCL (polled waits), the world group gloo (point-to-point by tag)
    assert groups.device == device and groups.backend == "nccl" and groups.stage_waits.polls
    assert not groups.waiter.polls and groups.stage_waits.errored() is None  # get_error(): SUCCESS
    assert allreduce_min(groups, [3, -2]) == [3, -2]
    assert allreduce_min(groups, [7], on_stage=True) == [7]
    assert broadcast_bytes(groups, b"abc", 0) == b"abc"
    reaper.retire(groups)  # abort() the communicators, then drop them
    assert reaper.drain(30) and reaper.live() == 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_pending_allreduce_is_interrupted_and_aborted() -> None:
    """Rank 0 all-reduces on the NCCL stage group, rank 1 never joins: the waiter gives up on
    interruption, the reaper aborts the stuck communicator, and the process lives on after the group
    timeout."""
    store, reaper = dist.HashStore(), GroupReaper()
    stops = [threading.Event(), threading.Event()]
    timeout = timedelta(seconds=5)

    def build(d: int) -> Groups:
        return reaper.track(
            build_groups(store, peer(d), stops[d], "nccl", timeout, device=torch.device("cuda", d))
        )

    built = on_both(build)
    buf = torch.ones(4, device="cuda:0")
    work = built[0].stage.allreduce([buf])
    later(0.2, stops[0].set)
    with pytest.raises(Interrupted):
        built[0].stage_waits.wait(work, "an all-reduce rank 1 never joins")
    for g in built:
        reaper.retire(g)
    assert reaper.drain(60) and reaper.live() == 0
    time.sleep(timeout.total_seconds() + 2)  # past the group timeout: still alive
    assert torch.ones(1, device="cuda:0").item() == 1.0
