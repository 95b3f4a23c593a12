"""Three "hosts" as network namespaces, each running one `recycle agent`, and a fourth ("ctl") with
the planner service and the rendezvous store (`recycle store`): what bench/multihost.py measures and
tests/test_multihost.py checks.

One job of D=3 pipelines x P=2 stages (tests/jobs.py's tiny_job(3, 2), the reference GPT's defaults).
Host h<d> runs the agent of pipeline d's two workers (`--workers "d,0;d,1"`, `--agent-id h<d>`); the
agents share one output directory and one checkpoint directory (`--checkpoint-dir`, every 2 stepped
iterations), as hosts share a file system. The job is registered over the service's HTTP API with
restore policy auto and a short heartbeat timeout (the service checks it every 0.2 s). Scenarios, each
on a fresh job, store and agents (one service for all), the fault once every worker stepped 3
iterations:

- crash: every process in h2 (its agent and both workers) is SIGKILLed: a host crash. Only the
  service's heartbeat timeout can notice it (h2's agent died too).
- partition: h2's link goes down (no process dies); once the survivors run the version that fails h2,
  it comes back: h2's workers find themselves failed and leave (EXIT_DROPPED), and h2's agent restarts
  them as fresh re-joiners (`rejoin` events), which copy their state from a peer.
- store: the store is SIGKILLed and, after the survivors stepped 2 more iterations without it,
  restarted empty on the same port (iterations paced to at least STORE_PACE_MS, so that the run is
  still going once the new store listens); then worker [2, 1] is SIGKILLed: h2's agent posts its `fail` at
  once and the survivors build the new version's groups on the restarted store.
- stage: once the job shows a checkpoint of every stage (reported when durable), worker [d, 1] of
  every host is SIGKILLed (stage 1 lost across all hosts, the agents live): the agents post the
  fails, the service restores from the shared checkpoint at once, the agents
  restart the dead workers with `--resume-at`, the stage-0 workers load it in place.

Measured from the fault, by watching the accounting files every 10 ms and the job every 50 ms:
`detect_s` (the job shows the fault: h2's workers failed, or a restore), `running_s` (every worker that
should run the new version wrote its `version` record of it), `step_s` (every such worker stepped under
it); partition: `cutoff_exit_s` (link up -> h2's cut-off workers exited) and `rejoin_s` (link up ->
both are alive again in a version); store: `steps_without_store` and `lost_iterations` (iterations
rolled back before the worker was killed: the store's restart must cost none).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from runtime_adapter.accounting import acct_path
from runtime_adapter.assignment import Worker
from runtime_adapter.model import GPTConfig
from tests.jobs import tiny_job
from tests.netns import IFNAME, Netns, tail, wait_for

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "multihost-controller-token"
SERVICE_PORT = 8000
STORE_PORT = 29500  # the first job's; each next job gets the next port
PIPELINES, STAGES = 3, 2
HOSTS = tuple(f"h{d}" for d in range(PIPELINES))  # host h<d> runs pipeline d
VICTIM_HOST = "h2"
VICTIMS: list[Worker] = [(2, s) for s in range(STAGES)]
SURVIVORS: list[Worker] = [(d, s) for d in range(PIPELINES - 1) for s in range(STAGES)]
EVERYONE: list[Worker] = [(d, s) for d in range(PIPELINES) for s in range(STAGES)]
STAGE_VICTIMS: list[Worker] = [(d, 1) for d in range(PIPELINES)]  # scenario "stage"
STORE_VICTIM: Worker = (2, 1)  # scenario "store"
SCENARIOS = ("crash", "partition", "store", "stage")
CHECKPOINT_EVERY = 2
# The store scenario's iterations last at least this long: restarting the store (importing torch) takes
# a few seconds, and the run must still be going when the worker is killed after it. 300 ms left the
# run nearly over once the store was back when the tests ran in two processes on 2 cores.
STORE_PACE_MS = 600.0


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Outcome:
    """What one scenario did; times in seconds from the fault."""

    scenario: str
    out: str
    job_id: str
    iterations: int
    heartbeat_timeout_s: float
    agent_codes: dict[str, int | None]  # host -> the agent's exit code
    fault_version: int  # the first version that shows the fault (fails the victims, or restores)
    detect_s: float
    running_s: float
    step_s: float
    resumed_from: dict[str, int] = field(default_factory=dict)  # worker -> `from` of its version record
    failed_at_detection: list[list[int]] = field(default_factory=list)
    cutoff_exit_s: float | None = None  # partition
    rejoin_s: float | None = None  # partition
    steps_without_store: int | None = None  # store: survivors' steps while it was down (min over them)
    lost_iterations: int | None = None  # store: iterations rolled back before the worker kill
    restore: dict[str, Any] | None = None  # stage: the job's restore field
    precomputed: bool = False  # every precompute key was done before the fault
    final_state: str = ""
    final_failed: list[list[int]] = field(default_factory=list)
    pids_before: dict[str, int] = field(default_factory=dict)  # worker -> its process at the fault
    pids_after: dict[str, int] = field(default_factory=dict)  # worker -> its last process

    def agent(self, host: str) -> int | None:
        """Exit code of host `host`'s agent."""
        return self.agent_codes[host]


class Records:
    """The workers' accounting files, read incrementally; each record with the time it was first seen."""

    def __init__(self, out: Path, workers: list[Worker]) -> None:
        self.out, self.workers = out, workers
        self.offset = {w: 0 for w in workers}
        self.seen: dict[Worker, list[tuple[float, dict[str, Any]]]] = {w: [] for w in workers}

    def poll(self) -> None:
        """Read what was appended since the last call (complete lines only)."""
        now = time.monotonic()
        for w in self.workers:
            try:
                with acct_path(self.out, w).open("rb") as f:
                    f.seek(self.offset[w])
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1
            self.offset[w] += end
            for line in data[:end].splitlines():
                try:
                    self.seen[w].append((now, json.loads(line)))
                except ValueError:
                    continue

    def steps(self, w: Worker, min_version: int = 0) -> int:
        """Step records of w at schedule version >= min_version."""
        return sum(1 for _, r in self.seen[w] if r.get("event") == "step" and r["version"] >= min_version)

    def count(self, w: Worker, event: str) -> int:
        """Records of kind `event` of w so far."""
        return sum(1 for _, r in self.seen[w] if r.get("event") == event)

    def first(self, w: Worker, event: str, min_version: int) -> tuple[float, dict[str, Any]] | None:
        """When w's first `event` record at version >= min_version was seen, and the record."""
        for t, r in self.seen[w]:
            if r.get("event") == event and int(r.get("version", -1)) >= min_version:
                return t, r
        return None


class MultiHost:
    """The namespaces (ctl, h0, h1, h2) and the planner service in ctl; `run_scenario` runs one job."""

    def __init__(self, root: Path, heartbeat_timeout_s: float = 2.0, heartbeat_check_s: float = 0.2) -> None:
        self.root = root
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_check_s = heartbeat_check_s
        self.net = Netns(["ctl", *HOSTS])
        self.jobs = 0

    @property
    def ctl(self) -> str:
        """The control namespace's address (service and stores)."""
        return self.net.addr("ctl")

    @property
    def base(self) -> str:
        """The service's URL (reachable from the namespaces only)."""
        return f"http://{self.ctl}:{SERVICE_PORT}"

    @property
    def service_log(self) -> Path:
        """Where the service's output goes."""
        return self.root / "service.log"

    def __enter__(self) -> MultiHost:
        self.net.__enter__()
        try:
            self._start_service()
        except BaseException:
            self.net.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.net.close()

    def env(self) -> dict[str, str]:
        """The environment of every process started in a namespace."""
        return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME)

    def _start_service(self) -> None:
        env = dict(self.env(), RECYCLE_CONTROLLER_TOKEN=TOKEN)
        env.update(
            RECYCLE_HEARTBEAT_CHECK_S=f"{self.heartbeat_check_s:g}",
            RECYCLE_PRECOMPUTE_TIME_LIMIT_S="1",
            RECYCLE_REFINE_TIME_LIMIT_S="1",
        )
        cmd = [sys.executable, "-m", "recycle_cli", "serve", "--host", self.ctl, "--port", str(SERVICE_PORT),
               "--data-dir", str(self.root / "service-data"), "--no-access-log"]  # fmt: skip
        proc = self.net.popen("ctl", cmd, log=self.service_log, env=env, cwd=ROOT)

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the service exited during start-up:\n{tail(self.service_log)}")
            try:
                return self.http("GET", "/readyz").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, 60, "the service's /readyz", 0.2)

    def http(self, method: str, path: str, body: Any = None, token: str = TOKEN) -> httpx.Response:
        """One request to the service, sent from the ctl namespace (a fresh connection, closed after)."""
        headers = {"Authorization": f"Bearer {token}"}
        url = self.base + path
        return self.net.call("ctl", httpx.request, method, url, json=body, headers=headers, timeout=10)

    def job_doc(self, job_id: str) -> dict[str, Any]:
        """GET /v1/jobs/{id}."""
        r = self.http("GET", f"/v1/jobs/{job_id}")
        r.raise_for_status()
        return dict(r.json())

    def logs(self, out: Path) -> list[Path]:
        """Every log file of a scenario run in `out`, and the service's."""
        return [*sorted(out.glob("*.log")), self.service_log]

    def start_store(self, out: Path, port: int) -> Any:
        """`recycle store` in ctl on `port` (its output appended to out/store.log)."""
        cmd = [sys.executable, "-m", "recycle_cli", "store", "--host", self.ctl, "--port", str(port)]
        return self.net.popen("ctl", cmd, log=out / "store.log", env=self.env(), cwd=ROOT)

    def run_scenario(
        self, scenario: str, out: Path, iterations: int = 30, pace_ms: float = 0.0,
        steps_before: int = 3, timeout_s: float = 150.0,
    ) -> Outcome:  # fmt: skip
        """Run one job through `scenario` (module doc). Raises TimeoutError (naming what did not
        happen) or RuntimeError (an agent exited too early)."""
        if scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {SCENARIOS}, not {scenario!r}")
        out.mkdir(parents=True, exist_ok=True)
        if scenario == "store":
            pace_ms = max(pace_ms, STORE_PACE_MS)
        job = tiny_job(PIPELINES, STAGES)
        body = {"job": job.model_dump(mode="json", exclude_none=True), "max_failures": 2,
                "heartbeat_timeout_s": self.heartbeat_timeout_s, "restore_policy": "auto"}  # fmt: skip
        r = self.http("POST", "/v1/jobs", body)
        if r.status_code != 201:
            raise RuntimeError(f"registering the job: HTTP {r.status_code} {r.text}")
        job_id, worker_token = r.json()["id"], r.json()["worker_token"]
        port = STORE_PORT + self.jobs
        self.jobs += 1
        run = _Run(self, scenario, out, job_id, iterations, port, self.start_store(out, port))
        for d, host in enumerate(HOSTS):
            cmd = [
                sys.executable, "-m", "recycle_cli", "agent",
                "--service", self.base, "--job-id", job_id, "--token", worker_token,
                "--workers", ";".join(f"{d},{s}" for s in range(STAGES)),
                "--store", f"{self.ctl}:{port}", "--iterations", str(iterations),
                "--model", json.dumps(asdict(GPTConfig())), "--out", str(out), "--agent-id", host,
                "--checkpoint-dir", str(out / "checkpoints"), "--checkpoint-every", str(CHECKPOINT_EVERY),
            ]  # fmt: skip
            if pace_ms > 0:
                cmd += ["--pace-ms", f"{pace_ms:g}"]
            run.agents[host] = self.net.popen(
                host, cmd, log=out / f"agent_{host}.log", env=self.env(), cwd=ROOT
            )
        try:
            return run.drive(steps_before, timeout_s)
        finally:
            for host in HOSTS:
                self.net.kill(host)
            for p in [*run.agents.values(), run.store]:
                self.net.stop(p)


class _Run:
    """One scenario's job, store and agents while it runs."""

    def __init__(
        self, mh: MultiHost, scenario: str, out: Path, job_id: str, iterations: int, port: int, store: Any
    ) -> None:
        self.mh, self.scenario, self.out, self.job_id = mh, scenario, out, job_id
        self.iterations, self.port, self.store = iterations, port, store
        self.agents: dict[str, Any] = {}
        self.recs = Records(out, EVERYONE)

    def pid(self, w: Worker) -> int:
        """The pid of worker w's current process (the agents write <out>/worker_<d>_<s>.pid)."""
        return int((self.out / f"worker_{w[0]}_{w[1]}.pid").read_text())

    def early_exit(self, hosts: list[str], what: str) -> None:
        for h in hosts:
            if self.agents[h].poll() is not None:
                raise RuntimeError(f"the agent of {h} exited with {self.agents[h].returncode} {what}")

    def drive(self, steps_before: int, timeout_s: float) -> Outcome:
        mh, recs = self.mh, self.recs

        def started() -> bool:
            recs.poll()
            self.early_exit(list(HOSTS), "before the fault")
            return all(recs.steps(w) >= steps_before for w in EVERYONE)

        wait_for(started, timeout_s, f"every worker to step {steps_before} iterations")
        if self.scenario == "stage":  # the restore is to load a checkpoint: one must be reported first

            def checkpointed() -> bool:
                return mh.job_doc(self.job_id).get("restorable_iteration") is not None

            wait_for(checkpointed, timeout_s, "a checkpoint of every stage to be reported", 0.05)
        doc = mh.job_doc(self.job_id)
        precomputed = doc["precompute"]["done"] >= doc["precompute"]["total"]
        if recs.steps(SURVIVORS[0]) >= self.iterations - 8:
            raise RuntimeError("the run was nearly over before the fault: give it more iterations")
        extra: dict[str, Any] = {}
        if self.scenario == "store":
            extra = self._store_outage(timeout_s)
        pids_before = self.pids()
        t0 = time.monotonic()
        victims, watch, alive_hosts = self._fault()
        detected, fault_version, failed, doc = self._detect(victims, watch, alive_hosts, timeout_s)
        running = [recs.first(w, "version", fault_version) for w in watch]
        steps = [recs.first(w, "step", fault_version) for w in watch]
        o = Outcome(
            scenario=self.scenario, out=str(self.out), job_id=self.job_id, iterations=self.iterations,
            heartbeat_timeout_s=mh.heartbeat_timeout_s, agent_codes={}, fault_version=fault_version,
            detect_s=detected - t0,
            running_s=max(x[0] for x in running if x is not None) - t0,
            step_s=max(x[0] for x in steps if x is not None) - t0,
            resumed_from={f"{w[0]},{w[1]}": int(x[1]["from"]) for w, x in zip(watch, running, strict=True)
                          if x is not None},
            failed_at_detection=failed, precomputed=precomputed, restore=doc.get("restore"),
            pids_before=pids_before, **extra,
        )  # fmt: skip
        if self.scenario == "partition":
            self._heal(o, timeout_s)
        wait_for(lambda: all(p.poll() is not None for p in self.agents.values()), timeout_s,
                 "every agent to exit")  # fmt: skip
        o.agent_codes = {h: p.returncode for h, p in self.agents.items()}
        doc = mh.job_doc(self.job_id)
        o.final_state, o.final_failed = doc["state"], sorted(doc["failed"])
        o.pids_after = self.pids()
        return o

    def pids(self) -> dict[str, int]:
        """Worker "d,s" -> the pid of its current (or last) process."""
        return {f"{w[0]},{w[1]}": self.pid(w) for w in EVERYONE}

    def _store_outage(self, timeout_s: float) -> dict[str, Any]:
        """Kill -9 the store, let the survivors step 2 iterations without it, restart it empty."""
        recs = self.recs
        self.mh.net.stop(self.store)
        recs.poll()
        before = {w: recs.steps(w) for w in EVERYONE}

        def stepped_on() -> bool:
            recs.poll()
            self.early_exit(list(HOSTS), "while the store was down")
            return all(recs.steps(w) >= before[w] + 2 for w in EVERYONE)

        wait_for(stepped_on, timeout_s, "every worker to step 2 iterations with the store down")
        without = min(recs.steps(w) - before[w] for w in EVERYONE)
        log = self.out / "store.log"
        listening = log.read_text().count("store listening on")
        self.store = self.mh.start_store(self.out, self.port)

        def up() -> bool:  # the workers would wait for it anyway; the figure is about the restart
            if self.store.poll() is not None:
                raise RuntimeError(f"the restarted store exited with {self.store.returncode}")
            return log.read_text().count("store listening on") > listening

        wait_for(up, timeout_s, "the restarted store to listen", 0.05)
        recs.poll()
        if recs.steps(SURVIVORS[0]) >= self.iterations - 5:
            raise RuntimeError("the run was nearly over once the store was back: pace it slower")
        lost = sum(recs.count(w, "rollback") for w in EVERYONE)
        return {"steps_without_store": without, "lost_iterations": lost}

    def _fault(self) -> tuple[list[Worker], list[Worker], list[str]]:
        """Inject the scenario's fault; (workers it hits, workers that must run the new version, hosts
        whose agents must stay up)."""
        net = self.mh.net
        if self.scenario == "crash":
            net.kill(VICTIM_HOST)
            return VICTIMS, SURVIVORS, [h for h in HOSTS if h != VICTIM_HOST]
        if self.scenario == "partition":
            net.link_down(VICTIM_HOST)
            return VICTIMS, SURVIVORS, [h for h in HOSTS if h != VICTIM_HOST]
        if self.scenario == "store":
            os.kill(self.pid(STORE_VICTIM), signal.SIGKILL)
            return [STORE_VICTIM], [w for w in EVERYONE if w != STORE_VICTIM], list(HOSTS)
        for w in STAGE_VICTIMS:
            os.kill(self.pid(w), signal.SIGKILL)
        return STAGE_VICTIMS, EVERYONE, list(HOSTS)

    def _detect(
        self, victims: list[Worker], watch: list[Worker], alive_hosts: list[str], timeout_s: float
    ) -> tuple[float, int, list[list[int]], dict[str, Any]]:
        """Wait until the job shows the fault and every watched worker stepped under that version."""
        detected: float | None = None
        fault_version, failed, doc, next_doc = 0, [], {}, 0.0
        restore = self.scenario == "stage"

        def recovered() -> bool:
            nonlocal detected, fault_version, failed, doc, next_doc
            self.recs.poll()
            self.early_exit(alive_hosts, "before the workers ran the new version")
            now = time.monotonic()
            if detected is None and now >= next_doc:
                next_doc = now + 0.05
                doc = self.mh.job_doc(self.job_id)
                hit = (
                    doc.get("restore") is not None
                    if restore
                    else all(list(w) in doc["failed"] for w in victims)
                )
                if hit:
                    detected, fault_version, failed = now, int(doc["version"]), doc["failed"]
            return detected is not None and all(self.recs.first(w, "step", fault_version) for w in watch)

        what = (
            "every worker to step under the restore" if restore else "the others to step without the victims"
        )
        wait_for(recovered, timeout_s, what, 0.01)
        assert detected is not None
        return detected, fault_version, failed, doc

    def _heal(self, o: Outcome, timeout_s: float) -> None:
        """Partition: bring h2's link back; time the cut-off workers' exit and their re-join."""
        cut = {w: self.pid(w) for w in VICTIMS}
        t_up = time.monotonic()
        self.mh.net.link_up(VICTIM_HOST)

        def gone() -> bool:
            return all(not _alive(pid) for pid in cut.values())

        o.cutoff_exit_s = (
            wait_for(gone, timeout_s, "the cut-off workers to exit after the link came back") - t_up
        )

        def rejoined() -> bool:
            doc = self.mh.job_doc(self.job_id)
            return not any(list(w) in doc["failed"] for w in VICTIMS)

        o.rejoin_s = wait_for(rejoined, timeout_s, "h2's workers to re-join", 0.05) - t_up


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (its agent may not have reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
