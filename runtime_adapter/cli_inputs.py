"""The runtime commands' inputs, checked with errors a user can act on (InvalidInputError: exit 2)."""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from planner.cli_io import read_document, writable_dir
from planner.contract import JobSpec
from planner.errors import InvalidInputError
from runtime_adapter.assignment import Worker
from runtime_adapter.settings import runtime_settings

PHASES = ("F", "B", "W", "BW", "OPT", "REDUCED", "MIGRATE")  # REDUCED: right after the gradient all-reduce;
# MIGRATE: a layer migration is planned, no tensor has moved yet
DEFAULT_ENTRY = "runtime_adapter.model:training"  # the reference GPT (keyword arguments: GPTConfig fields)


def read_job(path: str) -> JobSpec:
    """The job spec at `path` (docs/contract.md section 1)."""
    return read_document(path, JobSpec, "job spec")


def check_envelope_file(path: Path) -> None:
    """--schedule-file: a file that exists must be a schedule envelope now (one the launcher has
    not written yet is waited for, as the launcher writes it atomically after starting workers)."""
    from runtime_adapter.sources import envelope_problem

    if not path.exists():
        return
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"--schedule-file {path}: not readable JSON ({exc})") from None
    problem = envelope_problem(doc)
    if problem is not None:
        raise InvalidInputError(f"--schedule-file {path}: {problem}")


def service_url(text: str) -> str:
    """argparse type of --service: an http:// or https:// URL with a host (else exit 2 at once,
    before any worker starts)."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL with a host")
    return text


def parse_kwargs(text: str) -> dict[str, Any]:
    """--model: the entry point's keyword arguments as a JSON object."""
    try:
        kwargs = json.loads(text)
    except ValueError as e:
        raise InvalidInputError(f"--model {text!r}: not JSON ({e})") from e
    if not isinstance(kwargs, dict):
        raise InvalidInputError(f"--model {text!r}: expected a JSON object of keyword arguments")
    return kwargs


def add_model_args(p: argparse.ArgumentParser, check_data: bool = True) -> None:
    """--entry, --model and (for the commands that train) --check-data: what to train (the public API,
    runtime_adapter/training.py)."""
    p.add_argument(
        "--entry",
        default=DEFAULT_ENTRY,
        help="package.module:function returning a runtime_adapter.training.Training (default: the reference "
        "GPT); the current directory is importable",
    )
    p.add_argument(
        "--model",
        default="{}",
        help="the entry's keyword arguments as JSON (reference GPT: GPTConfig fields, optimizer, lr, clip, "
        "clip_scope, warmup)",
    )
    if not check_data:
        return
    p.add_argument(
        "--check-data",
        action="store_true",
        help="read every micro-batch twice and stop if the data function is not deterministic",
    )


def check_worker(job: JobSpec, worker: Worker) -> Worker:
    """`worker` if it is on the job's D x P grid."""
    d, s = worker
    if not (0 <= d < job.num_pipelines and 0 <= s < job.num_stages):
        raise InvalidInputError(
            f"worker [{d}, {s}] is not in the job's {job.num_pipelines} x {job.num_stages} grid "
            f"(--pipeline 0..{job.num_pipelines - 1}, --stage 0..{job.num_stages - 1})"
        )
    return worker


def parse_store(text: str) -> tuple[str, int]:
    """--store HOST:PORT."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInputError(f"--store {text!r}: expected HOST:PORT (e.g. 127.0.0.1:29500)")
    return host, int(port)


def parse_fail_at(text: str | None) -> tuple[int, str] | None:
    """--fail-at ITERATION:PHASE (fault injection)."""
    if not text:
        return None
    it, sep, phase = text.partition(":")
    if not sep or not it.isdigit() or phase not in PHASES:
        expected = f"expected ITERATION:PHASE with PHASE in {', '.join(PHASES)}"
        raise InvalidInputError(f"--fail-at {text!r}: {expected}")
    return int(it), phase


def check_min(flag: str, value: float | None, low: float, strict: bool = False) -> None:
    """`value` (if given) must be >= `low` (> `low` if `strict`)."""
    if value is not None and (value <= low if strict else value < low):
        raise InvalidInputError(f"{flag} must be {'above' if strict else 'at least'} {low:g}, not {value:g}")


def check_store_port(port: int) -> None:
    """--store-port: 0 (a free port) or a port this machine can listen on now."""
    if not 0 <= port < 65536:
        raise InvalidInputError(f"--store-port {port}: expected 0 (any free port) or 1..65535")
    if port == 0:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise InvalidInputError(f"--store-port {port}: cannot listen there ({e.strerror})") from e


def check_fresh_out(out: Path, checkpoints: str | os.PathLike[str], checkpointing: bool) -> None:
    """--out must not hold an earlier run's accounting (it is appended to), nor, with checkpointing,
    the checkpoint directory an earlier run's checkpoints (a restore would load them)."""
    from planner.cli_io import check_output_dir
    from runtime_adapter import checkpoint  # torch: not when only the parser is built

    check_output_dir(str(out), "--out")  # a regular file, or below one: one line before anything starts
    old = sorted(out.glob("acct_*.jsonl"))
    if old:
        raise InvalidInputError(
            f"--out {out} already holds a run ({old[0].name}): use a new directory or delete that one"
        )
    if checkpointing and checkpoint.has_checkpoints(checkpoints):
        raise InvalidInputError(
            f"checkpoint directory {checkpoints} holds checkpoints of an earlier run: "
            "use another --checkpoint-dir or delete them"
        )


def check_resumable(out: Path, job: JobSpec, service: bool, checkpoint_every: int) -> None:
    """`recycle launch --resume`: --out holds an earlier launch of this very job with --schedules (its
    job.json and schedule file), none of its workers still runs, and checkpointing is on."""
    if service:
        raise InvalidInputError(
            "--resume goes with --schedules (a job of the planner service restores from its own record: "
            "restore_policy auto)"
        )
    if checkpoint_every <= 0:
        raise InvalidInputError("--resume needs --checkpoint-every N, as the earlier launch had: it goes on "
                                "from the newest complete checkpoint")  # fmt: skip
    try:
        earlier = JobSpec.model_validate_json((out / "job.json").read_text())
    except (OSError, ValueError):
        raise InvalidInputError(f"--resume: --out {out} holds no launch (no readable job.json)") from None
    if earlier != job:
        raise InvalidInputError(f"--resume: --out {out} holds a launch of another job ({earlier.name!r}, "
                                "or the same name with other figures): give that job's --job")  # fmt: skip
    if not (out / "schedule.json").is_file():
        raise InvalidInputError(f"--resume: --out {out} has no schedule.json (not a launch with --schedules)")
    for pid_file in sorted(out.glob("worker_*_*.pid")):
        pid = read_pid(pid_file)
        if pid is not None and runs_in(pid, out):
            worker = pid_file.stem.removeprefix("worker_").replace("_", ", ")
            raise InvalidInputError(f"--resume: worker [{worker}] of the launch in {out} still runs "
                                    f"(pid {pid}): stop that launch first")  # fmt: skip


def read_pid(path: Path) -> int | None:
    """The process id in a pid file, None if unreadable."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def runs_in(pid: int, out: Path) -> bool:
    """Whether process `pid` is alive and a worker writing to `out`: its command line has `worker`
    and its output (descriptor 1) is a log in `out` (a worker forked by the fork server shows the
    server's command line, `python -m runtime_adapter.forkserver worker`); a reused pid is some other
    process."""
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        output = Path(os.readlink(f"/proc/{pid}/fd/1"))
    except OSError:
        return False
    return "worker" in argv and output.parent == out.resolve()


def resolve_checkpoint_every(value: int | None) -> int:
    """--checkpoint-every as given, else RECYCLE_CHECKPOINT_EVERY (runtime settings), else 0."""
    return runtime_settings().checkpoint_every if value is None else value


def check_checkpoint_dir(text: str | None) -> str | None:
    """--checkpoint-dir: a local directory that exists or can be created, and is writable; or an fsspec
    URL whose scheme fsspec knows (and whose package is installed). Not `memory://`: each process
    would see its own. The value to use (a URL that went through pathlib gets its `//` back)."""
    if text is None:
        return None
    import fsspec  # not when only the parser is built (the service image has neither)

    from runtime_adapter import checkpoint_io

    root = checkpoint_io.normalise(text)
    flag = f"--checkpoint-dir {text!r}"
    if checkpoint_io.is_url(root):
        scheme = root.split("://", 1)[0].lower()
        if scheme == "memory":
            raise InvalidInputError(f"{flag}: memory:// is private to each process; use a shared dir or URL")
        try:
            fsspec.get_filesystem_class(scheme)
        except ValueError as e:
            raise InvalidInputError(f"{flag}: unknown URL scheme {scheme!r} (fsspec: {e})") from e
        except ImportError as e:
            raise InvalidInputError(f"{flag}: {scheme}:// needs a package that is not installed ({e})") from e
        if scheme not in ("file", "local"):
            return root
        local = Path(checkpoint_io.Root(root).base)
    else:
        local = Path(root)
    existing = next(p for p in [local.absolute(), *local.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise InvalidInputError(f"{flag}: {existing} is not a directory")
    if not writable_dir(existing):
        raise InvalidInputError(f"{flag}: {existing} is not writable")
    return root


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """--checkpoint-dir and --checkpoint-every (default $RECYCLE_CHECKPOINT_EVERY, else 0: none)."""
    p.add_argument(
        "--checkpoint-dir",
        help="where the periodic checkpoints go (stage<s>/it<k>/, torch.distributed.checkpoint): a directory "
        "every host can read or an fsspec URL (file:///mnt/ckpt, s3://bucket/run)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="stepped iterations between checkpoints (default $RECYCLE_CHECKPOINT_EVERY or 0: none)",
    )
