"""Checkpoints (torch.distributed.checkpoint, asynchronous, local directory or fsspec URL): round trip,
the marker written last, retention, a writer killed -9 mid-save, no collectives from a rank of a gloo
group whose peer does not save, bitwise AdamW resumption, --checkpoint-dir checks, and a whole stage
lost in a real D=2, P=2 run (the launcher restarts every worker from the checkpoint)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import InvalidInputError
from runtime_adapter import checkpoint, checkpoint_io
from runtime_adapter.cli_inputs import check_checkpoint_dir, check_fresh_out
from runtime_adapter.launch import Launcher, LaunchSpec
from runtime_adapter.publishers import lost_stages
from tests.jobs import tiny_job
from tests.test_runtime_process import (
    CFG,
    assert_exactly_once,
    assert_matches_reference,
    assert_peers_identical,
    planner_schedules,
    records,
)

ROOT = Path(__file__).resolve().parents[1]


def _state(value: float) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    return {"w": torch.full((3,), value)}, {"state": {}, "param_groups": [{"lr": value, "params": [0]}]}


def _adamw(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()


@pytest.mark.parametrize("kind", ["dir", "file-url", "memory-url"])
def test_round_trip_keeps_the_newest_and_only_marked_ones_count(tmp_path: Path, kind: str) -> None:
    root = {
        "dir": str(tmp_path),
        "file-url": f"file://{tmp_path}",
        "memory-url": f"memory://{tmp_path.name}",
    }[kind]
    for k in range(1, 7):
        checkpoint.save_stage(root, 1, 2 * k, *_state(float(k)))
    assert checkpoint.stage_iterations(root, 1) == {8, 10, 12}  # KEEP = 3 newest
    state = checkpoint.load_stage(root, 1, 10)
    assert state["stepped"] == 10 and state["stage"] == 1
    assert torch.equal(state["model"]["w"], torch.full((3,), 5.0))
    assert state["optim"] == {"state": {}, "param_groups": [{"lr": 5.0, "params": [0]}]}  # empty dict kept
    r = checkpoint_io.Root(root)
    assert sorted(r.names(r.path("stage1"))) == ["it00000008", "it00000010", "it00000012"]
    # DCP's own files without the marker (a writer killed right before it) are not a checkpoint
    r.remove(r.path("stage1", "it00000012", checkpoint.MARKER))
    assert checkpoint.stage_iterations(root, 1) == {8, 10}
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.load_stage(root, 1, 12)
    checkpoint.save_stage(root, 0, 10, *_state(1.0))
    assert checkpoint.latest_complete(root, 2) == 10 and checkpoint.has_checkpoints(root)
    if kind == "memory-url":
        r.remove(r.base)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.integers(0, 12), max_size=5), min_size=1, max_size=4))
def test_latest_complete_is_the_newest_iteration_every_stage_has(per_stage: list[set[int]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for s, its in enumerate(per_stage):
            for k in its:
                folder = Path(checkpoint.stage_dir(d, s, k))
                folder.mkdir(parents=True)
                if k % 3:
                    (folder / checkpoint.MARKER).write_text("{}")
        complete = [{k for k in its if k % 3} for its in per_stage]
        common = set.intersection(*complete)
        assert checkpoint.latest_complete(Path(d), len(per_stage)) == (max(common) if common else None)


def test_adamw_resumes_bitwise(tmp_path: Path) -> None:
    """4 AdamW steps, save (async), 3 more; a fresh model and optimizer loaded from the checkpoint and
    trained the same 3 steps end bitwise equal (parameters and moments)."""
    model, optim = _adamw()
    _train(model, optim, range(4))
    writer, done = checkpoint.Checkpointer(f"file://{tmp_path}"), list[int]()
    writer.save(0, 4, model.state_dict(), optim.state_dict(), done.append)
    _train(model, optim, range(4, 7))  # at once: the saved state is a copy
    writer.close()
    assert done == [4]
    fresh, fresh_optim = _adamw(seed=1)
    state = checkpoint.load_stage(f"file://{tmp_path}", 0, 4)
    assert set(state["optim"]["state"]) == {0, 1, 2, 3}  # integer parameter ids, as torch.optim has them
    fresh.load_state_dict(state["model"])
    fresh_optim.load_state_dict(state["optim"])
    _train(fresh, fresh_optim, range(4, 7))
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    ref, got = optim.state_dict(), fresh_optim.state_dict()
    assert ref["param_groups"] == got["param_groups"]
    for i, s in ref["state"].items():
        assert s.keys() == got["state"][i].keys() and all(torch.equal(s[k], got["state"][i][k]) for k in s)


def test_save_returns_before_the_write_and_reports_it_once_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, write = threading.Event(), checkpoint_io.Root.save_tensors

    def held(self: checkpoint_io.Root, path: str, tensors: dict[str, torch.Tensor]) -> None:
        assert release.wait(30)
        write(self, path, tensors)

    monkeypatch.setattr(checkpoint_io.Root, "save_tensors", held)
    done: list[tuple[int, bool]] = []

    def on_done(k: int) -> None:  # the marker exists when it is called
        done.append((k, k in checkpoint.stage_iterations(tmp_path, 0)))

    writer = checkpoint.Checkpointer(tmp_path)
    model, optim = _state(1.0)
    writer.save(0, 2, model, optim, on_done)
    model["w"].add_(1.0)  # the training loop changes the parameters right after save returns
    assert writer.pending and checkpoint.stage_iterations(tmp_path, 0) == set() and not done
    second = threading.Thread(target=writer.save, args=(0, 4, model, optim, on_done))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # the next save waits for the previous write
    release.set()
    second.join(30)
    writer.close()
    assert done == [(2, True), (4, True)]
    assert torch.equal(checkpoint.load_stage(tmp_path, 0, 2)["model"]["w"], torch.full((3,), 1.0))
    assert torch.equal(checkpoint.load_stage(tmp_path, 0, 4)["model"]["w"], torch.full((3,), 2.0))


def test_a_failed_write_is_logged_not_raised_nor_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("not a directory")
    writer, done = checkpoint.Checkpointer(tmp_path / "file"), list[int]()
    writer.save(0, 2, *_state(1.0), done.append)
    writer.close()
    assert writer.failures == 1 and not done and "checkpoint of stage 0 at 2 not written" in caplog.text


def test_an_existing_complete_checkpoint_is_not_rewritten(tmp_path: Path) -> None:
    checkpoint.save_stage(tmp_path, 0, 4, *_state(1.0))
    checkpoint.save_stage(tmp_path, 0, 4, *_state(2.0))  # a replay after a rollback: the same state
    assert torch.equal(checkpoint.load_stage(tmp_path, 0, 4)["model"]["w"], torch.full((3,), 1.0))


def test_url_roots_and_paths() -> None:
    assert checkpoint_io.normalise("file:/mnt/ckpt") == "file:///mnt/ckpt"  # str(Path("file:///mnt/ckpt"))
    assert checkpoint_io.normalise(Path("s3://bucket/run")) == "s3://bucket/run"
    assert checkpoint_io.normalise("/mnt/ckpt") == "/mnt/ckpt" and not checkpoint_io.is_url("rel/dir")
    assert checkpoint.stage_dir("memory://x/", 2, 7) == "memory:///x/stage2/it00000007"
    assert checkpoint.stage_dir("file:///mnt/c", 0, 1) == "file:///mnt/c/stage0/it00000001"
    assert checkpoint.stage_dir("/mnt/c/", 0, 1) == "/mnt/c/stage0/it00000001"


def test_checkpoint_dir_is_checked(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    assert check_checkpoint_dir(str(tmp_path / "new" / "dir")) == str(tmp_path / "new" / "dir")
    assert check_checkpoint_dir(f"file:{tmp_path}") == f"file://{tmp_path}"  # str(Path(URL))
    assert check_checkpoint_dir(None) is None
    for bad, message in [
        (str(tmp_path / "f" / "sub"), "is not a directory"),
        (f"file://{tmp_path}/f/sub", "is not a directory"),
        ("memory://x", "private to each process"),
        ("nosuchscheme://x", "unknown URL scheme 'nosuchscheme'"),
    ]:
        with pytest.raises(InvalidInputError, match=message) as e:
            check_checkpoint_dir(bad)
        assert "\n" not in str(e.value)
    checkpoint.save_stage(tmp_path / "c", 0, 2, *_state(1.0))
    with pytest.raises(InvalidInputError, match="holds checkpoints of an earlier run"):
        check_fresh_out(tmp_path / "out", f"file://{tmp_path}/c", True)
    check_fresh_out(tmp_path / "out", tmp_path / "none", True)


def _python(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


_BIG_SAVE = """
    import sys, time, torch
    from runtime_adapter import checkpoint
    model = {f"w{i}": torch.full((25_000_000,), float(i)) for i in range(4)}  # 400 MB
    writer = checkpoint.Checkpointer(sys.argv[1])
    writer.save(0, 5, model, {"state": {}, "param_groups": []}, lambda k: print("durable", flush=True))
    print("saving", flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_a_writer_killed_mid_save_leaves_no_complete_checkpoint(tmp_path: Path) -> None:
    root = f"file://{tmp_path}"
    proc = _python(_BIG_SAVE, root)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "saving", proc.stderr.read() if proc.stderr else ""
        folder, deadline = Path(checkpoint.stage_dir(str(tmp_path), 0, 5)), time.monotonic() + 60
        while sum(f.stat().st_size for f in folder.glob("*.distcp")) < 50_000_000:  # mid-write
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.stdout.read() == ""  # never durable
    assert folder.is_dir() and not (folder / checkpoint.MARKER).exists()  # the torn write is there ...
    assert checkpoint.stage_iterations(root, 0) == set() and checkpoint.latest_complete(root, 1) is None
    with pytest.raises(FileNotFoundError):  # ... and never taken as complete
        checkpoint.load_stage(root, 0, 5)
    checkpoint.save_stage(root, 0, 7, *_state(7.0))  # the next save of the stage clears it
    assert not folder.exists() and checkpoint.stage_iterations(root, 0) == {7}


_GLOO_RANK = """
    import os, sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    from pathlib import Path
    rank, init, root, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=5))
    flag = Path(root.removeprefix("file://")) / "rank0-done"
    if rank == 1:  # never calls save; waits for rank 0, then one barrier together
        while not flag.exists():
            time.sleep(0.05)
        if mode == "ours":
            dist.barrier()
        print("rank 1 ok", flush=True)
        sys.exit(0)
    from runtime_adapter import checkpoint
    model, optim = {"w": torch.arange(6.0)}, {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}
    try:
        if mode == "ours":
            writer = checkpoint.Checkpointer(root)
            writer.save(1, 3, model, optim, lambda k: print("durable", k, flush=True))
            writer.close()
            assert checkpoint.load_stage(root, 1, 3)["optim"]["state"][0]["step"].item() == 3.0
        else:  # the control: DCP's default (no no_dist) with an initialised group
            import torch.distributed.checkpoint as dcp
            dcp.save(model, storage_writer=dcp.FileSystemWriter(root.removeprefix("file://") + "/plain"))
    except Exception as e:
        print("failed", type(e).__name__, flush=True)
        flag.touch()
        os._exit(3)  # not sys.exit: gloo's clean-up after the timed-out collective sometimes aborts (-6)
    flag.touch()
    dist.barrier()
    print("rank 0 ok", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ours", "control"])
def test_one_rank_of_a_gloo_group_saves_without_collectives(tmp_path: Path, mode: str) -> None:
    """The stage writer is one rank of the world group (gloo); its peer never calls save. Our save must
    not run collectives (it would hang until gloo's 5 s timeout and fail); the control shows that
    DCP's default save does exactly that, so the test can tell."""
    init, root = f"file://{tmp_path}/pg", f"file://{tmp_path}/ckpt"
    Path(root.removeprefix("file://")).mkdir()
    procs = [_python(_GLOO_RANK, str(r), init, root, mode) for r in (0, 1)]
    outs = [p.communicate(timeout=90) for p in procs]
    if mode == "ours":
        assert [p.returncode for p in procs] == [0, 0], outs
        assert outs[0][0].split("\n")[:2] == ["durable 3", "rank 0 ok"] and "rank 1 ok" in outs[1][0]
    else:
        assert procs[0].returncode == 3 and outs[0][0].startswith("failed"), outs


def test_lost_stages() -> None:
    assert lost_stages({(0, 1), (1, 1)}, 2, 2) == [1]
    assert lost_stages({(0, 1), (1, 0)}, 2, 2) == []
    assert lost_stages(set(), 3, 2) == []


@pytest.mark.timeout(150)
def test_whole_stage_lost_restarts_from_the_checkpoint(tmp_path: Path) -> None:
    """Both workers of stage 1 are killed -9 in iteration 5 (checkpoints every 2 iterations): the
    launcher restarts all four from the newest complete checkpoint (4, or 2 if stage 1's asynchronous
    write of 4 had not finished when it was killed), the iterations after it are replayed, and the
    final parameters equal failure-free training."""
    job, n = tiny_job(2, 2), 8
    spec = LaunchSpec(
        job, asdict(CFG), n, tmp_path, fail_at={(0, 1): (5, "F"), (1, 1): (5, "F")}, checkpoint_every=2
    )
    launcher = Launcher(spec, planner_schedules(job))  # type: ignore[arg-type]
    launcher.start()
    codes = launcher.wait(timedelta(seconds=140))
    assert all(rc == 0 for rc in codes.values()), codes
    assert launcher.restores == 1, launcher.events
    (restore,) = [e for e in launcher.history if e.kind == "restore"]
    assert restore.checkpoint in (2, 4) and "stage(s) [1] lost" in restore.why  # what the summary reports
    workers = spec.workers()
    for w in workers:
        resumed = [r["stepped"] for r in records(tmp_path, w) if r["event"] == "resume"]
        assert resumed == [restore.checkpoint], (w, resumed)
    assert checkpoint.latest_complete(spec.checkpoints, 2) == n
    assert_exactly_once(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, workers)
    assert_peers_identical(tmp_path, job)
