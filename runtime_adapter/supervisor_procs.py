"""The worker processes a supervisor (supervisor.py) starts on this machine: spawning them with the
worker command line (launch_spec.py), their logs and pid files, warm standbys, bringing a failed
worker back (a standby activated, or a restart as a fresh re-joiner, each reported as a `rejoin`),
the history of what happened (summary.LaunchEvent), and killing them all. When to do which is the
supervisor's policy.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from runtime_adapter.assignment import Worker
from runtime_adapter.forkserver import ForkServerError, shared
from runtime_adapter.launch_spec import LaunchSpec
from runtime_adapter.publishers import Publisher, Restore
from runtime_adapter.settings import runtime_settings
from runtime_adapter.stop_signals import WorkerPopen
from runtime_adapter.store import StoreClient
from runtime_adapter.summary import LaunchEvent

logger = logging.getLogger(__name__)
WORKER_MODULE = [sys.executable, "-m", "runtime_adapter.cli"]


def watching(cmd: list[str], parent: int) -> list[str]:
    """`cmd` with `--exit-with-parent` naming the worker's parent `parent`: a parent that dies
    before the worker looks is then noticed (the worker would otherwise watch whoever adopted it)."""
    return [f"--exit-with-parent={parent}" if a == "--exit-with-parent" else a for a in cmd]


class WorkerProcesses:
    """The processes of the local workers `workers` (default: the whole job)."""

    def __init__(self, spec: LaunchSpec, publisher: Publisher, workers: list[Worker] | None = None,
                 agent_id: str = "") -> None:  # fmt: skip
        self.spec, self.publisher = spec, publisher
        self.local: list[Worker] = list(workers) if workers is not None else spec.workers()
        self.agent_id = agent_id or f"launch-{spec.run_id}"
        self.procs: dict[Worker, subprocess.Popen[bytes]] = {}
        self.failed: set[Worker] = set()
        self.events: list[tuple[float, str, Worker]] = []
        self.history: list[LaunchEvent] = []
        self.standbys: dict[Worker, list[tuple[str, subprocess.Popen[bytes]]]] = {}
        # pid -> (its log, accounting size at start, first start of the job: not a re-join/standby/resume)
        self._started: dict[int, tuple[Path, int, bool]] = {}
        self.retired: list[subprocess.Popen[bytes]] = []
        self.num_standbys = 0
        self.store_client: StoreClient | None = None  # standby keys (set by start)
        self._nonce = uuid.uuid4().hex[:8]  # standby keys of this supervisor never meet an earlier one's
        # CPU workers are forked from a process that imported torch once (forkserver.py), unless turned
        # off (a GPU job; RECYCLE_FORK_WORKERS=0; a server that could not fork): plain processes then
        self._fork = spec.device == "cpu" and runtime_settings().fork_workers

    @property
    def version(self) -> int:
        """The newest schedule version the publisher made (as far as this supervisor knows)."""
        return self.publisher.version

    @property
    def store_address(self) -> tuple[str, int]:
        """Where the workers reach the store (set by `start`)."""
        assert self.store_client is not None, "start() first"
        return self.store_client.addr

    def acct_path(self, w: Worker) -> Path:
        """Worker `w`'s accounting file (JSON lines, appended by every process of `w`)."""
        return self.spec.out_dir / f"acct_{w[0]}_{w[1]}.jsonl"

    def lost_state(self, w: Worker, pid: int) -> tuple[int, str] | None:
        """(version, why) of the `lost` record process `pid` of `w` wrote (its version needed state no
        live worker holds: worker.py), None if it wrote none."""
        path, offset = self.acct_path(w), self._started.get(pid, (None, 0, False))[1]
        try:
            with path.open("rb") as f:
                f.seek(offset)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == "lost":
                return int(rec.get("version", 0)), str(rec.get("why", "state lost"))
        return None

    def event_id(self, kind: str, w: Worker, pid: int) -> str:
        """`agent-<agent id>-<kind>-<d>.<s>-<pid>`: unique per process, the same on every retry."""
        return f"agent-{self.agent_id}-{kind}-{w[0]}.{w[1]}-{pid}"

    def spawn_all(self) -> None:
        """Start every local worker (first starts)."""
        for w in self.local:
            self._spawn(w)

    def _spawn(
        self,
        w: Worker,
        rejoin: bool = False,
        standby_key: str | None = None,
        fail_at: tuple[int, str] | None = None,
        restore: Restore | None = None,
    ) -> subprocess.Popen[bytes]:
        name = f"worker_{w[0]}_{w[1]}" + (
            "" if standby_key is None else f"_standby{standby_key.rsplit('.', 1)[1]}"
        )
        log_path = self.spec.out_dir / f"{name}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
        env["LOCAL_RANK"] = str(self.local.index(w))  # --device cuda: cuda:<LOCAL_RANK % count>
        cmd = self.spec.command(
            w, self.store_address[1], rejoin, standby_key, fail_at, self.publisher.worker_args(),
            resume_at=None if restore is None else restore.iteration,
            restore_epoch=None if restore is None else restore.epoch,
        )  # fmt: skip
        acct = self.acct_path(w)
        offset = acct.stat().st_size if acct.exists() else 0
        proc = self._start(cmd, env, log_path)
        first = not rejoin and restore is None and standby_key is None
        self._started[proc.pid] = (log_path, offset, first)
        if standby_key is None:
            self._set_proc(w, proc)
        return proc

    def _start(self, cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        """A worker process running `cmd`, its output appended to `log_path`: forked from the fork
        server of this process (forkserver.shared), else a process of its own."""
        if self._fork and cmd[:3] == WORKER_MODULE:
            try:
                server = shared(env)
                argv = watching(cmd[3:], server.proc.pid)
                return server.spawn(argv, env, log_path)  # type: ignore[return-value]
            except (ForkServerError, OSError) as e:
                logger.warning("fork server unavailable (%s): starting workers as processes of their own", e)
                self._fork = False
        with log_path.open("ab") as log:
            return WorkerPopen(watching(cmd, os.getpid()), stdout=log, stderr=subprocess.STDOUT, env=env)

    def _set_proc(self, w: Worker, proc: subprocess.Popen[bytes]) -> None:
        """`proc` is now worker `w`'s process; its pid goes to <out>/worker_<d>_<s>.pid."""
        old = self.procs.get(w)
        if old is not None and old is not proc:
            self.retired.append(old)
        self.procs[w] = proc
        (self.spec.out_dir / f"worker_{w[0]}_{w[1]}.pid").write_text(f"{proc.pid}\n")

    def _record(
        self, kind: str, w: Worker | None, version_before: int | None = None, **detail: object
    ) -> None:
        now = time.monotonic()
        self.events.append((now, kind, w if w is not None else (-1, -1)))
        before = self.version if version_before is None else version_before
        self.history.append(LaunchEvent(now, kind, w, before, **detail))  # type: ignore[arg-type]

    def add_standby(self, w: Worker, fail_at: tuple[int, str] | None = None) -> None:
        """Start a warm replacement for `w` now (import, store connection); `activate` makes it join.
        `fail_at` counts iterations from the one it joins at."""
        self.num_standbys += 1
        key = f"recycle/{self.spec.run_id}/activate/{w[0]}.{w[1]}.{self._nonce}.{self.num_standbys}"
        self.standbys.setdefault(w, []).append((key, self._spawn(w, True, key, fail_at)))

    def activate(self, w: Worker) -> None:
        """Bring failed worker `w` back from its next standby, under a new version."""
        assert self.store_client is not None and w in self.failed
        key, proc = self.standbys[w].pop(0)
        self._set_proc(w, proc)
        acct = self.acct_path(w)  # its steps are the ones appended from now on
        self._started[proc.pid] = (self._started[proc.pid][0], acct.stat().st_size if acct.exists() else 0,
                                   False)  # fmt: skip
        self.failed.discard(w)
        self._record("rejoin", w)
        self.publisher.report("rejoin", [w], "warm standby activated", self.event_id("rejoin", w, proc.pid))
        self.store_client.set(key, str(self.version))

    def restart(self, w: Worker) -> None:
        """Start a failed worker again: it re-joins from a peer under the next version."""
        self.failed.discard(w)
        proc = self._spawn(w, rejoin=True)
        self._record("rejoin", w)
        self.publisher.report("rejoin", [w], "restarted", self.event_id("rejoin", w, proc.pid))

    def kill(self, w: Worker) -> None:
        """SIGKILL a worker (fault injection from outside)."""
        self.procs[w].kill()

    def terminate(self) -> None:
        """Kill every worker (and standby) this supervisor started."""
        spares = [p for v in self.standbys.values() for _, p in v]
        for p in [*self.procs.values(), *spares]:
            if p.poll() is None:
                p.kill()
                p.wait()
