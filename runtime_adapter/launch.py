"""`recycle launch`: start a D x P job on one machine and keep it going when workers die.

The supervision itself (spawn, reap, report deaths, warm standbys, re-joins, following restores) is
the agent's (supervisor.py); the Launcher adds what only a one-machine launch does: it hosts the
store (or uses an external one, `LaunchSpec.store`, e.g. a `recycle store`, which may die and be
restarted: store.py), writes `<out>/job.json`, and publishes the job: either a schedule file it writes
from `schedule_for(failed set)` (the planner, or a directory of precomputed schedules: the launcher
itself never plans) through a FilePublisher, or the planner service, whose job it registers and
controls (ServicePublisher: fail / rejoin events).

When a failure set loses a whole stage, a restore version is published (the FilePublisher writes it
into the schedule file, from the newest complete checkpoint; the service publishes its own) and the
supervisor restarts the workers that are not running with `--resume-at K --restore-epoch N`; the
survivors load the checkpoint in place. The Launcher's policy on top: with checkpointing off
(checkpoint_every 0) a lost stage ends the launch (LaunchError), and so does a lost state (workers that
left because a layer to migrate had no live holder: supervisor.py), more than `max_restores` restores
or a restore that does not come within RESTORE_WAIT_S.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from runtime_adapter.assignment import Worker
from runtime_adapter.launch_spec import SCHEDULE_FILE, LaunchSpec
from runtime_adapter.publishers import FilePublisher, Publisher, ScheduleFor, publish
from runtime_adapter.settings import runtime_settings
from runtime_adapter.store import StoreClient, StoreUnavailable
from runtime_adapter.supervisor import PROTOCOL_EXITS, LaunchError, Supervisor, WorkerStartupError

__all__ = [
    "PROTOCOL_EXITS",
    "SCHEDULE_FILE",
    "LaunchError",
    "LaunchSpec",
    "Launcher",
    "ScheduleFor",
    "WorkerStartupError",
    "publish",
]

RESTORE_WAIT_S = 60.0  # a lost stage waits this long for the service's restore version
NO_CHECKPOINT = (
    "no checkpoint exists (checkpointing is off; --checkpoint-every N turns it on), so the job cannot go on"
)


class Launcher(Supervisor):
    """Owns the store and every worker process of one job on this machine."""

    def __init__(
        self,
        spec: LaunchSpec,
        schedule_for: ScheduleFor | None = None,
        publisher: Publisher | None = None,
        max_restores: int = 3,
        report_failures: bool = True,
        resume: bool = False,
    ) -> None:
        """`publisher` (default: a FilePublisher over `schedule_for`, which publishes restores when
        checkpointing is on) gets every failure-set change; `report_failures=False` leaves deaths to
        the service's heartbeat timeout. `resume`: the publisher goes on from an earlier launch of
        this job (FilePublisher.resume): its first version is a restore, which every worker starts in."""
        if publisher is None:
            if schedule_for is None:
                raise ValueError("give a publisher or a schedule_for")
            checkpoints = spec.checkpoints if spec.checkpoint_every > 0 else None
            publisher = FilePublisher(spec.out_dir / SCHEDULE_FILE, spec.job, schedule_for, checkpoints)
        super().__init__(spec, publisher, spec.workers(), report_failures=report_failures,
                         max_restores=max_restores, restore_wait_s=RESTORE_WAIT_S)  # fmt: skip
        self.store: dist.TCPStore | None = None  # the store it hosts (None with an external one)
        self.resume = resume

    @property
    def schedule_path(self) -> Path:
        """The schedule file the workers poll."""
        return self.spec.out_dir / SCHEDULE_FILE

    def start(self) -> None:
        """Host the store (unless the spec names an external one), publish version 1 and start every
        worker (resuming: publish the restore version and start every worker in it)."""
        self.spec.out_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.out_dir / "job.json").write_text(self.spec.job.model_dump_json())
        timeout = runtime_settings().group_timeout
        if self.spec.store is not None:  # reconnects when the store is restarted
            self.store_client = StoreClient(self.spec.store, timeout)
            try:
                self.store_client.connect()
            except StoreUnavailable as e:
                raise LaunchError(str(e)) from e
        else:
            try:
                self.store = dist.TCPStore(
                    "127.0.0.1",
                    self.spec.store_port,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=60),
                )
            except RuntimeError as e:  # e.g. --store-port taken since it was checked
                raise LaunchError(f"cannot host the store on 127.0.0.1:{self.spec.store_port}: {e}") from e
            self.store_client = StoreClient(("127.0.0.1", self.store.port), timeout, server=self.store)
        self.publisher.start()
        if not self.resume:
            self.spawn_all()
            return
        restore = self._new_restore()
        if restore is None:
            raise LaunchError("resuming: the publisher published no restore version")
        self.lost_why = f"resumed the launch in {self.spec.out_dir}"  # the restore's reason
        self._follow(restore)  # every worker starts in the restore epoch

    def on_lost(self, stages: list[int]) -> None:
        """Without checkpoints a lost stage ends the launch."""
        if self.spec.checkpoint_every <= 0:
            self.terminate()
            raise LaunchError(f"stage(s) {stages} lost (all their workers failed): {NO_CHECKPOINT}")
        super().on_lost(stages)

    def on_state_lost(self, why: str, left: list[tuple[Worker, str]]) -> list[int]:
        """Without checkpoints a lost state (a layer without a live holder) ends the launch."""
        if self.spec.checkpoint_every <= 0:
            self.terminate()
            raise LaunchError(f"{why}: {NO_CHECKPOINT}")
        return super().on_state_lost(why, left)

    def check_restore(self, why: str) -> None:
        """No restore without checkpoints (the service may publish one from scratch), nor beyond
        max_restores."""
        if self.spec.checkpoint_every <= 0:
            self.terminate()
            raise LaunchError(f"{why}: {NO_CHECKPOINT}")
        super().check_restore(why)
