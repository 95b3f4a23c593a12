"""`recycle agent`: the workers of one host of a service job (one agent per host).

Started by whatever starts processes on a host (Slurm, a Kubernetes pod, docker compose), with the
service, the job id, the job's worker token, its workers and the rendezvous store. The supervision
is supervisor.py's, the same code `recycle launch` runs: it starts its workers (LOCAL_RANK = the
index among its workers), posts a dead worker's `fail` at once (event id
`agent-<agent id>-fail-<d>.<s>-<pid>`, retried with the same id while the service is unreachable),
re-joins dropped workers, keeps warm standbys (`--standby`), never kills a survivor because a peer
died, and follows the job's versions: on a new restore epoch it restarts its workers that are not
running with `--resume-at K --restore-epoch N`.

It ends (`run`) once every process exited and either all of its workers finished or the job is
`finished` (a worker of it failed and the others went on without it). The service's refusal (token,
job gone) or a worker's start-up error ends it with an error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Self

from runtime_adapter.assignment import Worker
from runtime_adapter.launch_spec import LaunchSpec
from runtime_adapter.service_publisher import ServicePublisher
from runtime_adapter.settings import runtime_settings
from runtime_adapter.store import StoreClient, StoreUnavailable
from runtime_adapter.supervisor import LaunchError, Supervisor

logger = logging.getLogger(__name__)

FOREVER = timedelta(days=3650)


class Agent(Supervisor):
    """One host's workers of a service job (see the module docstring)."""

    def __init__(
        self,
        spec: LaunchSpec,
        service: ServicePublisher,
        workers: list[Worker],
        agent_id: str,
        rejoin: bool = True,
        max_rejoins: int = 3,
        standby: bool = False,
    ) -> None:
        """`spec.store` is the job's store; `service` is attached to the job (job_id, worker token)."""
        super().__init__(spec, service, workers, agent_id=agent_id, rejoin_dropped=rejoin,
                         max_rejoins=max_rejoins, keep_standby=standby)  # fmt: skip
        self.service = service

    def start(self) -> None:
        """Write <out>/job.json, connect to the store, attach to the job (and follow its versions),
        start every worker (and with `standby` a warm standby per worker)."""
        out = self.spec.out_dir
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".job.json.{os.getpid()}"  # atomic: agents sharing a directory write the same
        tmp.write_text(self.spec.job.model_dump_json())
        os.replace(tmp, out / "job.json")
        assert self.spec.store is not None, "an agent uses the job's store"
        self.store_client = StoreClient(self.spec.store, runtime_settings().group_timeout)
        try:
            self.store_client.connect()
        except StoreUnavailable as e:
            raise LaunchError(str(e)) from e
        self.service.start()
        self.spawn_all()
        if self.keep_standby:
            for w in self.local:
                self.add_standby(w)

    def settled(self) -> bool:
        """Every process exited, and all finished or the job did (without a failed one of ours)."""
        if not super().settled():
            return False
        return all(w in self.finished for w in self.local) or self.service.job_state() == "finished"

    def run(self, on_tick: Callable[[Self], None] | None = None) -> dict[Worker, int]:
        """Supervise until settled (no time limit); the exit code of each worker's last process."""
        return self.wait(FOREVER, on_tick)
