"""Multi-host figures: three "hosts" as network namespaces, the planner service and the rendezvous
store (`recycle store`; a TCPStore in a few lines of Python where the CLI has no `store`) in a fourth.

    python -m bench.multihost [--reps 3] [--iterations 30] [--heartbeat-timeout 2]
                              [--scenarios crash,partition] [--out docs/bench/multihost.json]

Needs root (CAP_NET_ADMIN) for `ip netns`; the namespaces come from tests/netns.py. One job of D=3
pipelines x P=2 stages (tests/jobs.py's tiny_job(3, 2), the reference GPT's defaults), pipeline d's
two workers in namespace h<d>, each a `recycle worker --service http://<ctl>:8000 --store <ctl>:<port>`
process started directly (no launcher); the job is registered over the service's HTTP API with a
short heartbeat timeout (the service checks it every 0.2 s), so the service alone notices a lost
host. Two scenarios, each on a fresh job, store and workers (one service for all):

- crash: once every worker stepped 3 iterations, kill -9 both workers of h2 (a host crash);
- partition: once every worker stepped 3 iterations, take h2's link down (no process dies); once the
  survivors run the new version, bring it back: the cut-off workers must leave (EXIT_DROPPED, 4).

Measured from the fault, by watching the accounting files every 10 ms and the job's state every 50 ms:
`detected` (the service lists both h2 workers as failed), `running` (every survivor wrote its
`version` record of a version that fails them: it recovered and runs it), `first step` (every survivor
stepped an iteration under it); for the partition also `cut-off exit`, from the link coming back to
both h2 workers having exited. Medians over `--reps`; a table on stdout, everything as JSON in `--out`.

The heartbeat stays on to the end when the service has the `finished` job state (its job document
lists the `done` workers): survivors that complete post `done` and the job ends `finished`. On a
service without it, the heartbeat is turned off (PATCH) once the survivors run the new version, as
`recycle launch` used to do when its workers were done: otherwise survivors that finish and stop
polling would be declared failed one by one, and the cut-off workers would see `needs_restore`.

`run_scenario` is also what tests/test_multihost.py runs (once, with assertions on the outcome).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
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
from tests.netns import IFNAME, Netns, netns_unavailable, tail, wait_for

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "multihost-controller-token"
SERVICE_PORT = 8000
STORE_PORT = 29500  # the first job's; each next job gets the next port
PIPELINES, STAGES = 3, 2
HOSTS = tuple(f"h{d}" for d in range(PIPELINES))  # host h<d> runs pipeline d
VICTIM_HOST = "h2"
VICTIMS: list[Worker] = [(2, s) for s in range(STAGES)]
SURVIVORS: list[Worker] = [(d, s) for d in range(PIPELINES - 1) for s in range(STAGES)]
SCENARIOS = ("crash", "partition")
STORE_SRC = (
    "import sys, time, torch.distributed as dist\n"
    "store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False)\n"
    "print('store listening on', sys.argv[1], sys.argv[2], flush=True)\n"
    "while True:\n"
    "    time.sleep(3600)\n"
)


def store_command(host: str, port: int) -> list[str]:
    """`recycle store --host H --port P` where this checkout has it, else a TCPStore server in a few
    lines of Python (what the rendezvous is either way)."""
    try:
        from planner.cli import build_parser

        sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        if "store" in sub.choices:
            return [sys.executable, "-m", "planner.cli", "store", "--host", host, "--port", str(port)]
    except Exception:  # an older or broken CLI: the fallback below works without it
        pass
    return [sys.executable, "-c", STORE_SRC, host, str(port)]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Outcome:
    """What one scenario did; times in seconds from the fault (the kill, or the link going down)."""

    scenario: str
    out: str
    job_id: str
    iterations: int
    heartbeat_timeout_s: float
    codes: dict[str, int | None]  # "d,s" -> exit code
    fault_version: int  # the first version that lists every h2 worker as failed
    detect_s: float  # the service lists every h2 worker as failed (polled every 50 ms)
    running_s: float  # every survivor wrote its `version` record of fault_version or newer
    step_s: float  # every survivor stepped an iteration under fault_version or newer
    cutoff_exit_s: float | None = None  # partition: link up -> both h2 workers exited
    resumed_from: dict[str, int] = field(default_factory=dict)  # survivor -> `from` of that version record
    failed_at_detection: list[list[int]] = field(default_factory=list)
    precomputed: bool = False  # every precompute key was done before the fault
    store: str = ""  # what served the rendezvous
    heartbeat_kept: bool = True  # heartbeats stayed on to the end (the service has the finished state)
    final_state: str = ""  # the job's state once every worker exited
    final_failed: list[list[int]] = field(default_factory=list)

    def code(self, w: Worker) -> int | None:
        """Exit code of worker w."""
        return self.codes[f"{w[0]},{w[1]}"]


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

    def _start_service(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), RECYCLE_CONTROLLER_TOKEN=TOKEN)
        env.update(
            RECYCLE_HEARTBEAT_CHECK_S=f"{self.heartbeat_check_s:g}",
            RECYCLE_PRECOMPUTE_TIME_LIMIT_S="1",
            RECYCLE_REFINE_TIME_LIMIT_S="1",
        )
        cmd = [sys.executable, "-m", "api.cli", "--host", self.ctl, "--port", str(SERVICE_PORT),
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

    def run_scenario(
        self,
        scenario: str,
        out: Path,
        iterations: int = 30,
        pace_ms: float = 0.0,
        steps_before: int = 3,
        timeout_s: float = 150.0,
    ) -> Outcome:
        """Run one job through `scenario` ("crash" or "partition"); see the module doc. Raises
        TimeoutError (naming what did not happen) or RuntimeError (a worker exited too early)."""
        if scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {SCENARIOS}, not {scenario!r}")
        out.mkdir(parents=True, exist_ok=True)
        job = tiny_job(PIPELINES, STAGES)
        (out / "job.json").write_text(job.model_dump_json(indent=2) + "\n")
        body = {"job": job.model_dump(mode="json", exclude_none=True), "max_failures": 2,
                "heartbeat_timeout_s": self.heartbeat_timeout_s}  # fmt: skip
        r = self.http("POST", "/v1/jobs", body)
        if r.status_code != 201:
            raise RuntimeError(f"registering the job: HTTP {r.status_code} {r.text}")
        job_id, worker_token = r.json()["id"], r.json()["worker_token"]
        store_port = STORE_PORT + self.jobs
        self.jobs += 1
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME)
        store_cmd = store_command(self.ctl, store_port)
        store = self.net.popen("ctl", store_cmd, log=out / "store.log", env=env, cwd=ROOT)
        procs = {}
        for d, s in [(d, s) for d in range(PIPELINES) for s in range(STAGES)]:
            cmd = [
                sys.executable, "-m", "runtime_adapter.cli", "worker",
                "--job", str(out / "job.json"), "--pipeline", str(d), "--stage", str(s),
                "--service", self.base, "--job-id", job_id, "--token", worker_token,
                "--store", f"{self.ctl}:{store_port}", "--iterations", str(iterations),
                "--model", json.dumps(asdict(GPTConfig())), "--out", str(out),
            ]  # fmt: skip
            if pace_ms > 0:
                cmd += ["--pace-ms", f"{pace_ms:g}"]
            procs[(d, s)] = self.net.popen(HOSTS[d], cmd, log=out / f"worker_{d}_{s}.log", env=env, cwd=ROOT)
        try:
            outcome = self._drive(scenario, out, job_id, iterations, procs, steps_before, timeout_s)
            outcome.store = "recycle store" if "planner.cli" in store_cmd else "a TCPStore in python -c"
            return outcome
        finally:
            for p in [*procs.values(), store]:
                self.net.stop(p)

    def _drive(
        self,
        scenario: str,
        out: Path,
        job_id: str,
        iterations: int,
        procs: dict[Worker, Any],
        steps_before: int,
        timeout_s: float,
    ) -> Outcome:
        recs = Records(out, list(procs))

        def early_exit(workers: list[Worker], what: str) -> None:
            for w in workers:
                if procs[w].poll() is not None:
                    raise RuntimeError(f"worker {list(w)} exited with {procs[w].returncode} {what}")

        def started() -> bool:
            recs.poll()
            early_exit(list(procs), "before the fault")
            return all(recs.steps(w) >= steps_before for w in procs)

        wait_for(started, timeout_s, f"every worker to step {steps_before} iterations")
        doc = self.job_doc(job_id)
        precomputed = doc["precompute"]["done"] >= doc["precompute"]["total"]
        has_finished_state = "done" in doc  # the list of workers that reported `done`
        if recs.steps(SURVIVORS[0]) >= iterations - 2:
            raise RuntimeError("the run was nearly over before the fault: give it more iterations")

        t0 = time.monotonic()
        if scenario == "crash":
            self.net.kill(VICTIM_HOST)
        else:
            self.net.link_down(VICTIM_HOST)
        detected: float | None = None
        fault_version, failed, next_doc = 0, [], 0.0

        def recovered() -> bool:
            nonlocal detected, fault_version, failed, next_doc
            recs.poll()
            early_exit(SURVIVORS, "before running the new version")
            now = time.monotonic()
            if detected is None and now >= next_doc:
                next_doc = now + 0.05
                doc = self.job_doc(job_id)
                if all(list(w) in doc["failed"] for w in VICTIMS):
                    detected, fault_version, failed = now, int(doc["version"]), doc["failed"]
            return detected is not None and all(recs.first(w, "step", fault_version) for w in SURVIVORS)

        wait_for(recovered, timeout_s, "the survivors to step under a version that fails h2", 0.01)
        assert detected is not None
        if not has_finished_state:
            self.http("PATCH", f"/v1/jobs/{job_id}", {"heartbeat_enabled": False}).raise_for_status()
        running = [recs.first(w, "version", fault_version) for w in SURVIVORS]
        steps = [recs.first(w, "step", fault_version) for w in SURVIVORS]
        outcome = Outcome(
            scenario=scenario,
            out=str(out),
            job_id=job_id,
            iterations=iterations,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            codes={},
            fault_version=fault_version,
            detect_s=detected - t0,
            running_s=max(x[0] for x in running if x is not None) - t0,
            step_s=max(x[0] for x in steps if x is not None) - t0,
            resumed_from={
                f"{w[0]},{w[1]}": int(x[1]["from"])
                for w, x in zip(SURVIVORS, running, strict=True)
                if x is not None
            },
            failed_at_detection=failed,
            precomputed=precomputed,
            heartbeat_kept=has_finished_state,
        )
        if scenario == "partition":
            t_up = time.monotonic()
            self.net.link_up(VICTIM_HOST)
            gone = wait_for(lambda: all(procs[w].poll() is not None for w in VICTIMS), timeout_s,
                            "the cut-off workers to exit after the link came back")  # fmt: skip
            outcome.cutoff_exit_s = gone - t_up
        wait_for(lambda: all(p.poll() is not None for p in procs.values()), timeout_s,
                 "every worker to exit")  # fmt: skip
        outcome.codes = {f"{d},{s}": p.returncode for (d, s), p in procs.items()}
        doc = self.job_doc(job_id)
        outcome.final_state, outcome.final_failed = doc["state"], sorted(doc["failed"])
        return outcome


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Per scenario: repetitions and the median of each time."""
    out: dict[str, dict[str, Any]] = {}
    for scenario in SCENARIOS:
        runs = [o for o in outcomes if o.scenario == scenario]
        if not runs:
            continue
        out[scenario] = {
            "runs": len(runs),
            "detect_s": _median([o.detect_s for o in runs]),
            "running_s": _median([o.running_s for o in runs]),
            "step_s": _median([o.step_s for o in runs]),
            "cutoff_exit_s": _median([o.cutoff_exit_s for o in runs if o.cutoff_exit_s is not None]),
            "running_s_all": [round(o.running_s, 3) for o in runs],
        }
    return out


def table(summary: dict[str, dict[str, Any]], heartbeat_timeout_s: float) -> str:
    """The medians as a text table, with issue 9's targets."""

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    targets = {"crash": "< 2 s", "partition": f"<= {heartbeat_timeout_s + 1:g} s (timeout + 1 s)"}
    names = {"crash": "host crash (kill -9)", "partition": "partition (link down)"}
    head: tuple[str, ...] = ("scenario", "runs", "detected", "running new version", "first step",
                             "cut-off exit", "heartbeat timeout", "target (running)")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for scenario, m in summary.items():
        times = [fmt(m[k]) for k in ("detect_s", "running_s", "step_s", "cutoff_exit_s")]
        rows.append((names[scenario], str(m["runs"]), *times, f"{heartbeat_timeout_s:g}", targets[scenario]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(seconds from the fault, medians; cut-off exit: from the link coming back)"


def _run_all(root: Path, args: argparse.Namespace, scenarios: list[str]) -> tuple[list[Outcome], list[str]]:
    """Every repetition of every scenario on one MultiHost: the outcomes and the failures' messages."""
    outcomes: list[Outcome] = []
    errors: list[str] = []
    with MultiHost(root, heartbeat_timeout_s=args.heartbeat_timeout) as mh:
        for rep in range(args.reps):
            for scenario in scenarios:
                say(f"{scenario} {rep + 1}/{args.reps} ...")
                try:
                    o = mh.run_scenario(scenario, root / f"{scenario}-{rep}", args.iterations, args.pace_ms)
                except (TimeoutError, RuntimeError) as e:
                    errors.append(f"{scenario} {rep + 1}: {e}")
                    say(f"  failed: {e}")
                    continue
                outcomes.append(o)
                say(f"  detected {o.detect_s:.2f} s, running {o.running_s:.2f} s, first step {o.step_s:.2f} s"
                    + (f", cut-off exit {o.cutoff_exit_s:.2f} s" if o.cutoff_exit_s is not None else "")
                    + f", exit codes {o.codes}")  # fmt: skip
    return outcomes, errors


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.multihost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each scenario (default 3)")
    ap.add_argument("--iterations", type=int, default=30, help="iterations of each job (default 30)")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="workers' --pace-ms (default 0)")
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0, help="the job's heartbeat timeout, s")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: crash,partition")
    ap.add_argument("--out", default="docs/bench/multihost.json", help="JSON figures (default %(default)s)")
    ap.add_argument("--keep", help="keep the runs' directories (logs, accounting files) here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    if not scenarios or any(s not in SCENARIOS for s in scenarios):
        print(f"error: --scenarios takes {','.join(SCENARIOS)}", file=sys.stderr)
        return 2
    if args.reps < 1 or args.iterations < 10 or not args.heartbeat_timeout > 0:
        print("error: --reps >= 1, --iterations >= 10 and --heartbeat-timeout > 0", file=sys.stderr)
        return 2
    reason = netns_unavailable()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the namespaces are removed on the way out
    import tempfile

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-multihost-"))
    load_before = list(os.getloadavg())
    try:
        outcomes, errors = _run_all(root, args, scenarios)
    except KeyboardInterrupt:
        print("interrupted (every process and namespace of this run is gone)", file=sys.stderr)
        return 130
    summary = summarize(outcomes)
    print(table(summary, args.heartbeat_timeout))
    doc = {
        "what": "seconds from the fault to: detected (service lists h2's workers failed), running (every "
        "survivor recovered into that version), first step (every survivor stepped under it); cut-off exit "
        "from the link coming back",
        "job": {
            "pipelines": PIPELINES,
            "stages": STAGES,
            "microbatches": 4,
            "model": asdict(GPTConfig()),
            "iterations": args.iterations,
            "pace_ms": args.pace_ms,
        },
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "heartbeat_check_s": 0.2,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "load_before": load_before,
        "medians": summary,
        "runs": [asdict(o) for o in outcomes],
        "errors": errors,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"figures written to {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
