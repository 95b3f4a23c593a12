"""Check the runtime end to end on this machine's GPUs (or CPU), in one command.

    python -m bench.gpu_check [--device auto|cpu|cuda] [--pipelines 2] [--stages 2] [--microbatches 4]
                              [--iterations 8] [--entry E --model JSON] [--keep DIR] [--json]

1. `recycle profile` a D x P job on the device; 2. `recycle precompute` its plans (up to one failed
worker) and read the predicted iteration time of the failure-free plan and of the victim's failure;
3. `recycle launch` a failure-free run, then a paced run (`--pace-ms`, so that there is time to act)
whose victim worker is killed with SIGKILL once loss.csv shows a few iterations; 4. compare the alive
workers' final parameters with the failure-free run's (runtime_adapter.reference.relative_error),
the measured iteration time (per worker the median `wall_ms` of the failure-free run's step records
after the first iteration, bench.runtime.steady_ms; the slowest worker) with the prediction, and
report the recovery time the launch's summary prints.

Point-to-point traffic (activations, gradients between stages) always goes over gloo on CPU tensors
(runtime_adapter/comm.py); the stage all-reduce goes over NCCL when every worker has a GPU of its own,
else over gloo (NCCL cannot put two ranks on one device): the output says which, and why when it
falls back. On a GPU the workers run with deterministic algorithms (devices.activate), so the kill
run's parameters should equal the failure-free run's; CPU runs are bitwise equal.

Progress on stderr; a table (or with --json one JSON object) on stdout. Exit 0 when every step ran
and the parameter difference is within --tolerance, else 1 with a one-line reason; 2 (one line, nothing
run) for bad input: a flag out of range, an unusable --keep, --device cuda or --backend nccl without a
GPU. Every process
started here (each launch in a session of its own, with its workers) is killed on any exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from planner.errors import InvalidInputError
from runtime_adapter.assignment import Worker

PREFIX = "gpu_check"


class StepFailed(Exception):
    """A step of the check failed; the message is the one-line reason."""


def say(msg: str) -> None:
    print(f"{PREFIX}: {msg}", file=sys.stderr, flush=True)


@dataclass
class Result:
    """What the check found (the --json object)."""

    ok: bool = False
    reason: str = ""
    device: str = ""
    backend: str = ""
    backend_note: str = ""
    pipelines: int = 0
    stages: int = 0
    microbatches: int = 0
    iterations: int = 0
    victim: list[int] = field(default_factory=list)
    killed_in_iteration: int | None = None
    param_rel_diff: float | None = None
    tolerance: float = 0.0
    measured_iteration_ms: float | None = None
    measured_per_worker_ms: dict[str, float] = field(default_factory=dict)
    predicted_iteration_ms: float | None = None
    predicted_failed_iteration_ms: float | None = None
    recovery_s: float | None = None
    wall_s: float = 0.0
    outputs: str | None = None


class Children:
    """The processes started here, each the leader of a new session (its workers join its group)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        """SIGKILL every group started here (also the workers a finished launch may have left)."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def recycle_cmd(*args: str) -> list[str]:
    """`recycle ARGS` with this interpreter (no dependence on PATH)."""
    return [sys.executable, "-m", "recycle_cli", *args]


def run_step(children: Children, name: str, cmd: list[str], log: Path, timeout: float) -> str:
    """Run `cmd` to completion (output to `log`); its output, or StepFailed naming the step."""
    with log.open("wb") as f:
        p = children.start(cmd, f)
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise StepFailed(f"{name} took longer than {timeout:.0f} s (log {log})") from None
    text = log.read_text(errors="replace")
    if code != 0:
        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise StepFailed(f"{name} exited {code}: {last[0].strip()} (log {log})")
    return text


def pick_backend(device_arg: str, requested: str, num_workers: int) -> tuple[str, str, str]:
    """(--device for the commands, backend, why it is not the request or ""): the launch's rule."""
    from runtime_adapter.devices import job_devices

    device, backend, why = job_devices(device_arg, requested, num_workers)
    return device, backend, why or ""


def wait_loss_rows(launch: subprocess.Popen[bytes], loss_csv: Path, rows: int, timeout: float) -> None:
    """Until loss.csv holds `rows` iterations (StepFailed if the launch ends first or time runs out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launch.poll() is not None:
            raise StepFailed(f"the launch ended (exit {launch.returncode}) before the kill: raise --pace-ms")
        try:
            if len(loss_csv.read_text().splitlines()) - 1 >= rows:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise StepFailed(f"loss.csv showed fewer than {rows} iterations within {timeout:.0f} s")


def killed_iteration(text: str, victim: Worker) -> int | None:
    """The iteration the launch says the victim died in (None: before its first step or not seen)."""
    tag = f"worker {list(victim)} died in iteration "
    for line in text.splitlines():
        if line.startswith(tag):
            return int(line[len(tag) :].split()[0])
    return None


def param_diff(kill_out: Path, free_out: Path, workers: list[Worker]) -> float:
    """Largest relative error of a worker's final parameters, kill run vs failure-free run."""
    import torch

    from runtime_adapter.reference import relative_error

    def load(out: Path, w: Worker) -> dict[str, torch.Tensor]:
        path = out / f"final_{w[0]}_{w[1]}.pt"
        if not path.exists():
            raise StepFailed(f"{path} missing: worker {list(w)} did not finish")
        return dict(torch.load(path, map_location="cpu"))

    return max(relative_error(load(kill_out, w), load(free_out, w)) for w in workers)


def predicted_ms(job_path: Path, plans: Path, victim: Worker) -> tuple[float, float]:
    """The planner's iteration time of the failure-free plan and of the plan without `victim`."""
    from planner.contract import JobSpec
    from runtime_adapter.schedules import open_schedules

    job = JobSpec.model_validate_json(job_path.read_text())
    source = open_schedules(str(plans), job)
    return source(frozenset()).iteration_time_ms, source(frozenset([victim])).iteration_time_ms


def check(args: argparse.Namespace, work: Path, res: Result, children: Children) -> None:
    """Steps 1-4 of the module docstring, filling `res` as they go (StepFailed on a failing step)."""
    from bench.runtime import steady_ms
    from runtime_adapter.summary import recovery_times

    D, P, M, N = args.pipelines, args.stages, args.microbatches, args.iterations
    workers = [(d, s) for d in range(D) for s in range(P)]
    victim: Worker = (D - 1, P - 1)
    res.victim = list(victim)
    model = ["--entry", args.entry] if args.entry else []
    model += ["--model", args.model] if args.model else []
    job, plans = work / "job.json", work / "plans"

    say(f"profiling {D} x {P} (M={M}) on {res.device}")
    prof = ["profile", "--stages", str(P), "--pipelines", str(D), "--microbatches", str(M)]
    prof += ["--repeats", str(args.repeats), "--device", res.device, *model, "-o", str(job)]
    run_step(children, "recycle profile", recycle_cmd(*prof), work / "profile.log", args.timeout)
    say("planning every failure set of up to one worker")
    pre = ["precompute", str(job), "--max-failures", "1", "--no-progress", "-o", str(plans)]
    run_step(children, "recycle precompute", recycle_cmd(*pre), work / "precompute.log", args.timeout)
    res.predicted_iteration_ms, res.predicted_failed_iteration_ms = predicted_ms(job, plans, victim)

    launch = ["launch", "--job", str(job), "--schedules", str(plans), "--device", res.device]
    launch += ["--backend", res.backend, "--iterations", str(N), *model]
    say(f"failure-free run: {N} iterations over {res.backend}")
    free = work / "free"
    cmd = recycle_cmd(*launch, "--out", str(free))
    run_step(children, "failure-free launch", cmd, work / "free.log", args.timeout)
    warmup = 1 if N > 2 else 0
    res.measured_per_worker_ms = {k: round(v, 3) for k, v in steady_ms(free, workers, warmup).items()}
    res.measured_iteration_ms = max(res.measured_per_worker_ms.values())

    kill = work / "kill"
    rows = max(1, N // 3)
    say(f"kill run: SIGKILL to worker {list(victim)} after {rows} iteration(s) (paced {args.pace_ms:g} ms)")
    kill_log = work / "kill.log"
    with kill_log.open("wb") as f:
        cmd = recycle_cmd(*launch, "--out", str(kill), "--pace-ms", str(args.pace_ms))
        p = children.start(cmd, f)
        wait_loss_rows(p, kill / "loss.csv", rows, args.timeout)
        pid = int((kill / f"worker_{victim[0]}_{victim[1]}.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        try:
            code = p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise StepFailed(f"the kill run took longer than {args.timeout:.0f} s (log {kill_log})") from None
    text = kill_log.read_text(errors="replace")
    if code != 0:
        raise StepFailed(f"the kill run exited {code}: the survivors did not finish (log {kill_log})")
    res.killed_in_iteration = killed_iteration(text, victim)
    times = recovery_times(text)
    if not times:
        raise StepFailed(f"the kill run reports no recovery of worker {list(victim)} (log {kill_log})")
    res.recovery_s = times[0]
    res.param_rel_diff = param_diff(kill, free, [w for w in workers if w != victim])
    if res.param_rel_diff > args.tolerance:
        raise StepFailed(
            f"parameters differ by {res.param_rel_diff:.2e} (relative) from the failure-free run, "
            f"above the tolerance {args.tolerance:.0e}"
        )


def table(res: Result) -> str:
    """The human-readable report."""

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} ms"

    lines = [
        f"gpu_check: device {res.device}, {res.pipelines} x {res.stages} workers, M={res.microbatches}, "
        f"{res.iterations} iterations"
    ]
    if res.param_rel_diff is not None:
        lines.append(f"  parameters  max relative difference, kill run vs failure-free: "
                     f"{res.param_rel_diff:.1e} (tolerance {res.tolerance:.0e})")  # fmt: skip
    ratio = (
        f" (measured/predicted {res.measured_iteration_ms / res.predicted_iteration_ms:.2f})"
        if res.measured_iteration_ms and res.predicted_iteration_ms
        else ""
    )
    lines.append(f"  iteration   measured {ms(res.measured_iteration_ms)} (failure-free, median), "
                 f"predicted {ms(res.predicted_iteration_ms)}{ratio}")  # fmt: skip
    where = "" if res.killed_in_iteration is None else f" in iteration {res.killed_in_iteration}"
    lines.append(f"  failure     worker {res.victim} killed{where}; predicted "
                 f"{ms(res.predicted_failed_iteration_ms)} per iteration without it")  # fmt: skip
    rec = "-" if res.recovery_s is None else f"training again after {res.recovery_s:.2f} s"
    lines.append(f"  recovery    {rec}")
    note = f" ({res.backend_note})" if res.backend_note else ""
    lines.append(f"  backend     point-to-point: gloo (CPU tensors); stage all-reduce: {res.backend}{note}")
    lines.append(f"  outputs     {res.outputs or 'removed (--keep DIR keeps them)'}")
    lines.append(f"  took        {res.wall_s:.1f} s")
    lines.append("OK" if res.ok else f"FAILED: {res.reason}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu; default), cpu, cuda, cuda:N"
    )
    ap.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "gloo", "nccl"],
        help="default auto: nccl when every worker has a GPU of its own, else gloo",
    )
    ap.add_argument("--pipelines", type=int, default=2, help="D (default 2)")
    ap.add_argument("--stages", type=int, default=2, help="P (default 2)")
    ap.add_argument("--microbatches", type=int, default=4, help="M (default 4)")
    ap.add_argument("--iterations", type=int, default=8, help="iterations per run (default 8, at least 3)")
    ap.add_argument("--entry", help="training entry point package.module:function (default: reference GPT)")
    ap.add_argument("--model", help="the entry point's keyword arguments as JSON")
    ap.add_argument("--repeats", type=int, default=3, help="profiler repeats (default 3)")
    ap.add_argument("--pace-ms", type=float, default=250.0, help="iteration pacing of the kill run (ms)")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="max relative parameter difference")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per step (default 600)")
    ap.add_argument("--keep", metavar="DIR", help="keep the outputs in DIR (new or empty)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return ap


class Interrupted(StepFailed):
    """SIGTERM, SIGHUP or SIGINT: the check stops (every child killed) and reports it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.code = 128 + signum


class BadInput(StepFailed):
    """A flag out of range, an unusable --keep, a device or backend this machine lacks: exit 2."""

    code = 2


def _check_flags(args: argparse.Namespace) -> None:
    if min(args.stages, args.microbatches, args.repeats) < 1 or args.pipelines < 2 or args.iterations < 3:
        raise BadInput(
            "--pipelines >= 2 (a killed worker needs a peer), --stages, --microbatches, --repeats >= 1 "
            "and --iterations >= 3"
        )
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise BadInput(f"--tolerance {args.tolerance}: a relative difference >= 0")
    if args.keep and Path(args.keep).exists() and not Path(args.keep).is_dir():
        raise BadInput(f"--keep {args.keep}: exists and is not a directory")
    if args.keep and Path(args.keep).is_dir() and any(Path(args.keep).iterdir()):
        raise BadInput(f"--keep {args.keep}: not empty")


def _on_signal(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when it passed, else 1 (128 + N on signal N) with a one-line reason on stderr."""
    args = parser().parse_args(argv)
    t0 = time.monotonic()
    res = Result(pipelines=args.pipelines, stages=args.stages, microbatches=args.microbatches)
    res.iterations, res.tolerance = args.iterations, args.tolerance
    children = Children()
    work: Path | None = None
    code = 1
    caught = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {sig: signal.signal(sig, _on_signal) for sig in caught}
    try:
        _check_flags(args)
        workers = args.pipelines * args.stages
        try:
            res.device, res.backend, res.backend_note = pick_backend(args.device, args.backend, workers)
        except InvalidInputError as e:  # --device cuda or --backend nccl without a GPU
            raise BadInput(str(e)) from None
        if res.backend_note:
            say(f"backend {res.backend}: {res.backend_note}")
        if args.keep:
            work = Path(args.keep)
            work.mkdir(parents=True, exist_ok=True)
            res.outputs = str(work)
        else:
            work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        check(args, work, res, children)
        res.ok = True
    except StepFailed as e:
        res.reason, code = str(e), getattr(e, "code", 1)
    except Exception as e:  # anything else (bad plan directory, unreadable file): still one line
        res.reason = f"{type(e).__name__}: {e}"
    finally:
        for sig in caught:  # nothing cuts the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        children.kill_all()
        if work is not None and not args.keep:
            if res.ok:
                shutil.rmtree(work, ignore_errors=True)
            else:
                res.outputs = str(work)  # kept: the logs the reason names
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    res.wall_s = round(time.monotonic() - t0, 1)
    if code == BadInput.code:  # nothing ran: the reason alone, as every recycle command does
        print(f"error: {res.reason}", file=sys.stderr, flush=True)
        return code
    print(json.dumps(asdict(res)) if args.json else table(res), flush=True)
    if not res.ok:
        say(f"FAILED: {res.reason}")
    return 0 if res.ok else code


if __name__ == "__main__":
    sys.exit(main())
