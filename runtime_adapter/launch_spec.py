"""What `recycle launch` starts: `LaunchSpec`, pure data, so a dry run can show every worker's command.

Each worker is `python -m runtime_adapter.cli worker ...` with the job spec the launcher writes to
`<out>/job.json`, the rendezvous store (the one the launcher hosts on 127.0.0.1:`store_port`, 0: a
free port; or an external one, `store`, e.g. a `recycle store`) and its schedule source (the
schedule file in `<out>`, or the service).
"""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.contract import JobSpec
from runtime_adapter.assignment import Worker
from runtime_adapter.cli_inputs import DEFAULT_ENTRY

SCHEDULE_FILE = "schedule.json"


@dataclass
class LaunchSpec:
    """What to start: pure data, so a dry run can show every worker's command line."""

    job: JobSpec
    model: dict[str, Any]  # the entry point's keyword arguments (--model)
    num_iterations: int
    out_dir: Path
    backend: str = "gloo"
    entry: str = DEFAULT_ENTRY
    device: str = "cpu"  # each worker's --device; "cuda" picks cuda:<LOCAL_RANK % count>
    check_data: bool = False
    fail_at: dict[Worker, tuple[int, str]] = field(default_factory=dict)
    checkpoint_every: int = 0
    checkpoint_dir: Path | str | None = None  # a directory or an fsspec URL; default: <out_dir>/checkpoints
    pace_ms: float = 0.0
    store_port: int = 0  # the rendezvous store's port; 0: a free one, chosen at start
    store: tuple[str, int] | None = None  # an external store (host, port); None: the launcher hosts one
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # namespace of the store keys

    @property
    def store_host(self) -> str:
        """The host the workers reach the store at."""
        return self.store[0] if self.store is not None else "127.0.0.1"

    @property
    def checkpoints(self) -> Path | str:
        """The checkpoint directory (or URL)."""
        return self.checkpoint_dir if self.checkpoint_dir is not None else self.out_dir / "checkpoints"

    def workers(self) -> list[Worker]:
        """All D x P workers."""
        return [(d, s) for d in range(self.job.num_pipelines) for s in range(self.job.num_stages)]

    def command(
        self,
        worker: Worker,
        store_port: int,
        rejoin: bool = False,
        standby_key: str | None = None,
        fail_at: tuple[int, str] | None = None,
        source_args: list[str] | None = None,
        resume_at: int | None = None,
        restore_epoch: int | None = None,
    ) -> list[str]:
        """The command line of `worker`'s process (a re-joiner's if `rejoin`; a warm standby's if
        `standby_key`, which waits for the launcher to set that store key before joining; one that
        starts in restore epoch `restore_epoch` from the checkpoint at stepped count `resume_at`, None:
        the initial parameters). `source_args`: where it polls (default: the schedule file in
        out_dir). The spec's `fail_at` applies to first starts only."""
        d, s = worker
        if source_args is None:
            source_args = ["--schedule-file", str(self.out_dir / SCHEDULE_FILE)]
        cmd = [
            sys.executable, "-m", "runtime_adapter.cli", "worker",
            "--job", str(self.out_dir / "job.json"),
            "--pipeline", str(d), "--stage", str(s),
            *source_args,
            "--store", f"{self.store_host}:{store_port}",
            "--run-id", self.run_id,
            "--iterations", str(self.num_iterations),
            "--entry", self.entry,
            "--model", json.dumps(self.model),
            "--out", str(self.out_dir),
            "--backend", self.backend,
            "--device", self.device,
            "--exit-with-parent",
        ]  # fmt: skip
        if self.check_data:
            cmd.append("--check-data")
        if self.checkpoint_every > 0:
            cmd += ["--checkpoint-every", str(self.checkpoint_every)]
        cmd += ["--checkpoint-dir", str(self.checkpoints)]  # a URL stays as given
        if self.pace_ms > 0:
            cmd += ["--pace-ms", f"{self.pace_ms:g}"]
        if rejoin:
            cmd.append("--rejoin")
        restored = restore_epoch is not None
        if restored:
            cmd += ["--resume-at", "none" if resume_at is None else str(resume_at)]
            cmd += ["--restore-epoch", str(restore_epoch)]
        if standby_key is not None:
            cmd += ["--standby-key", standby_key]
        fail = fail_at if (rejoin or restored) else self.fail_at.get(worker)
        if fail is not None:
            cmd += ["--fail-at", f"{fail[0]}:{fail[1]}"]
        return cmd

    def dry_run(self, store_port: int | None = None, source_args: list[str] | None = None) -> str:
        """One line per worker: its command (store port: `store_port`, else the spec's)."""
        default = self.store[1] if self.store is not None else self.store_port
        port = default if store_port is None else store_port
        return "\n".join(
            f"{list(w)}: {' '.join(self.command(w, port, source_args=source_args))}" for w in self.workers()
        )
