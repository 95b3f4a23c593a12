"""The runtime commands' inputs, checked with errors a user can act on (InvalidInputError: exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from planner.cli_io import read_document
from planner.contract import JobSpec
from planner.errors import InvalidInputError
from runtime_adapter.assignment import Worker

if TYPE_CHECKING:
    from runtime_adapter.model import GPTConfig

PHASES = ("F", "B", "W", "BW", "OPT")


def read_job(path: str) -> JobSpec:
    """The job spec at `path` (CONTRACT.md section 1)."""
    return read_document(path, JobSpec, "job spec")


def read_model(text: str) -> GPTConfig:
    """--model: GPTConfig fields as a JSON object."""
    from runtime_adapter.model import GPTConfig

    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise TypeError("expected a JSON object of GPTConfig fields")
        return GPTConfig(**fields)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"--model {text!r}: {e}") from e


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


def check_schedules_dir(path: str, first: str) -> Path:
    """--schedules: a directory holding at least the failure-free schedule `first`."""
    directory = Path(path)
    if not (directory / first).is_file():
        raise InvalidInputError(
            f"--schedules {path}: no {first} there (write it with `recycle plan JOB -o {directory / first}`)"
        )
    return directory
