"""A layer migration that finds a layer without any live holder (real processes, CPU, gloo, kill -9):
the job's state is lost, and the workers leave for a restore (docs/runtime.md, "Layer migration").

The reference GPT, D=2 x P=2, 4 blocks ([0, 2) and [2, 4) at home), checkpoints every 2 iterations:

1. [1, 0] is killed -9 in iteration 2; v2 moves block 1 from stage 0 to stage 1 ([0, 1) / [1, 4));
   while layers are moved no stage writes a checkpoint (the newest complete one stays at 2);
2. [1, 0] re-joins (a warm standby); v3 moves block 1 back: [0, 0] takes it from [0, 1], and dies
   inside the commit (tests/migration_entry.py `die_switching`: after the commit all-reduce, before
   its own switch), while stage 1 switched to [2, 4): block 1's only copy was on [0, 0], and the
   re-joiner [1, 0] has no state yet;
3. v4 (failed {[0, 0]}: stage 0 still has [1, 0], so no stage is lost for the controller) moves block
   1 to stage 1 again: no live worker holds it. Every worker of v4 logs "layer 1: no live worker
   holds it", writes a `lost` record and exits EXIT_NEEDS_RESTORE; the launcher asks for a restore:
   with checkpoints, restore epoch 1 from the checkpoint at 2 (before the move), every worker
   restarted on its own layers, and the job ends with losses and final parameters equal to
   single-process training; without checkpoints, the launch ends with one line naming the layer.

If v4 keeps the job's own split, nothing moves, but stage 0's only alive worker is a re-joiner with
nothing to copy from: it leaves the same way, and the others load the checkpoint in place. With the
service as controller, `ServicePublisher.restore_lost` gets the restore from the real service.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from bench.migration import partitioned_schedules, records
from runtime_adapter.assignment import Worker
from runtime_adapter.checkpoint import latest_complete
from runtime_adapter.launch import Launcher, LaunchError, LaunchSpec
from runtime_adapter.migration_job import with_derived_layers
from runtime_adapter.model import training
from runtime_adapter.service_publisher import ServicePublisher
from tests.jobs import tiny_job
from tests.test_api_live import TOKEN, free_port, server
from tests.test_runtime_process import (
    CFG,
    assert_exactly_once,
    assert_losses_match,
    assert_matches_reference,
)

VICTIM: Worker = (1, 0)
EVERYONE: list[Worker] = [(d, s) for d in range(2) for s in range(2)]
MOVE = [[0, 1], [1, 4]]  # v2: block 1 to stage 1; v4: the same move, with block 1 gone


def launch(out: Path, n: int, checkpoint_every: int, v4: list[list[int]] | None = MOVE) -> Launcher:
    """Steps 1-3 above (`v4`: the partition of v4, None: the job's own); the Launcher, waited for
    (LaunchError without checkpoints)."""
    job = with_derived_layers(tiny_job(2, 2, 2), training(**asdict(CFG)), optimizer_copies=1, mib_per_ms=1.0)
    model: dict[str, Any] = {**asdict(CFG), "die_switching": [0, 0, 0, 2]}
    spec = LaunchSpec(job, model, n, out, fail_at={VICTIM: (2, "F")}, pace_ms=60,
                      checkpoint_every=checkpoint_every)  # fmt: skip
    spec.entry = "tests.migration_entry:training"
    moved = {frozenset({VICTIM}): MOVE, **({frozenset({(0, 0)}): v4} if v4 is not None else {})}
    launcher = Launcher(spec, partitioned_schedules(job, moved))
    launcher.start()
    launcher.add_standby(VICTIM)

    def on_tick(lr: Launcher) -> None:  # the re-join once the survivors trained under v2 (and the
        # checkpoint from before the move is complete: the restore's)
        moved = sum(1 for r in records(out, (0, 0), "step") if r["version"] == 2) >= 2
        saved = checkpoint_every == 0 or latest_complete(spec.checkpoints, 2) == 2
        if moved and saved and lr.standbys.get(VICTIM) and VICTIM in lr.failed:
            lr.activate(VICTIM)

    launcher.wait(timedelta(seconds=300), on_tick)
    return launcher


def lost_records(out: Path) -> dict[Worker, list[tuple[int, str]]]:
    """Every worker's `lost` records (version, why)."""
    got = {w: [(r["version"], r["why"]) for r in records(out, w, "lost")] for w in EVERYONE}
    return {w: v for w, v in got.items() if v}


LOST = (4, "layer 1: no live worker holds it (stage 1 needs it)")


@pytest.mark.timeout(150)
def test_a_lost_layer_restores_from_the_checkpoint_before_the_move(tmp_path: Path) -> None:
    n, job = 8, tiny_job(2, 2, 2)
    launcher = launch(tmp_path, n, checkpoint_every=2)
    codes = launcher.wait(timedelta(seconds=1))
    assert all(c == 0 for c in codes.values()), codes
    assert lost_records(tmp_path) == {w: [LOST] for w in [(0, 1), (1, 0), (1, 1)]}
    for w in [(0, 1), (1, 0), (1, 1)]:  # one line each, naming the layer
        log = "".join(f.read_text() for f in tmp_path.glob(f"worker_{w[0]}_{w[1]}*.log"))  # (standby)
        assert log.count("layer 1: no live worker holds it") == 1 and "Traceback" not in log, log[-2000:]
    restores = [e for e in launcher.history if e.kind == "restore"]
    assert [(e.checkpoint, e.why) for e in restores] == [(2, f"v{LOST[0]}: {LOST[1]}")], restores
    assert (0, 0) in restores[0].restarted  # (the others: by the restore, or when they left after it)
    doc = json.loads(launcher.schedule_path.read_text())
    assert doc["restore"] == {"epoch": 1, "iteration": 2} and "partition" not in doc["schedule"], doc
    for w in EVERYONE:  # every module back on its own layers, trained on from the checkpoint
        resumed = [r for r in records(tmp_path, w, "resume")]
        assert [r["stepped"] for r in resumed][-1:] == [2], (w, resumed)
    assert_exactly_once(tmp_path, job, n)
    assert_losses_match(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, EVERYONE)


@pytest.mark.timeout(150)
def test_a_lost_layer_without_checkpoints_ends_the_launch(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(tmp_path, 8, checkpoint_every=0)
    took = time.monotonic() - t0
    message = str(info.value)
    assert message.startswith(f"v{LOST[0]}: {LOST[1]}: no checkpoint exists (checkpointing is off"), message
    assert "\n" not in message and took < 100, took
    assert lost_records(tmp_path)  # the workers left for it (not a timeout)


def test_the_service_restores_a_lost_state(tmp_path: Path) -> None:
    """With the service as controller (restore policy auto): `restore_lost` reports the workers that
    left failed, one by one, until the service answers with the restore (here the first: [0, 0] was
    stage 0's last worker); the rest are not reported (they would be dropped from the restore)."""
    port = free_port()
    with server(tmp_path / "data", port):
        pub = ServicePublisher(f"http://127.0.0.1:{port}", TOKEN, tiny_job(2, 2, 2), heartbeat_enabled=False,
                               restore_policy="auto")  # fmt: skip
        pub.start()
        try:
            assert pub.report("fail", [VICTIM], "killed", "e-victim").version == 2
            why = f"v4: {LOST[1]}"
            left = [((0, 0), "e-00"), ((0, 1), "e-01"), ((1, 1), "e-11")]
            outcome = pub.restore_lost(left, why)
            restore = pub.latest_restore()
            assert restore is not None and (restore.epoch, restore.iteration) == (1, None), restore
            assert outcome.version == pub.version and outcome.lost_stages == [0], outcome
            posted = [a.get("event_id") for _, a in pub.answers]
            assert posted == ["e-victim", "e-00"], posted
            status = pub.status()
            assert status["state"] == "running" and status["failed"] == [], status
        finally:
            pub.finish()


@pytest.mark.timeout(150)
def test_a_stage_of_re_joiners_restores_and_the_others_load_in_place(tmp_path: Path) -> None:
    """v4 keeps the job's own split: nothing moves, but stage 0's only alive worker is the re-joiner
    [1, 0] (its state was to come from [0, 0]): it leaves ("stage 0: no live worker holds its
    state"), the launcher restores, [0, 1] and [1, 1] (blocked in iteration 4, waiting for stage 0)
    load the checkpoint in place."""
    n, job = 8, tiny_job(2, 2, 2)
    launcher = launch(tmp_path, n, checkpoint_every=2, v4=None)
    codes = launcher.wait(timedelta(seconds=1))
    assert all(c == 0 for c in codes.values()), codes
    why = "stage 0: no live worker holds its state (only re-joiners)"
    assert lost_records(tmp_path) == {VICTIM: [(4, why)]}
    in_place = {
        w: [r["stepped"] for r in records(tmp_path, w, "resume") if r.get("in_place")] for w in EVERYONE
    }
    assert in_place == {(0, 0): [], (0, 1): [2], (1, 0): [], (1, 1): [2]}, in_place
    assert_exactly_once(tmp_path, job, n)
    assert_losses_match(tmp_path, job, n)
    assert_matches_reference(tmp_path, job, n, EVERYONE)
