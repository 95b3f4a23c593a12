"""Reading the CLI's input documents and checking its output paths, with errors a user can act on."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from planner.contract import FailureScenario, SlowWorker
from planner.contract_fields import unread_fields
from planner.errors import InvalidInputError

Doc = TypeVar("Doc", bound=BaseModel)


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the field path."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")  # our validators name their field first
        lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
    return "\n".join(lines)


def read_document(path: str, model: type[Doc], what: str) -> Doc:
    """Parse `path` as JSON into `model`; InvalidInputError names the file and the field. Fields of a
    job spec or failure scenario that recycle does not read are named on stderr (a misspelt field).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidInputError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InvalidInputError(
            f"{what} {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8 JSON"
        ) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(
            f"{what} {path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    except RecursionError:
        raise InvalidInputError(f"{what} {path} is nested too deeply to be a {what}") from None
    try:
        doc = model.model_validate(data)
    except ValidationError as exc:
        raise InvalidInputError(
            f"{what} {path} is not a valid {what}:\n{describe_validation_error(exc)}"
        ) from exc
    for line in unread_fields(doc):
        print(f"warning: {what} {path}: {line}", file=sys.stderr)
    return doc


def parse_worker(text: str, flag: str) -> tuple[int, int]:
    """'d,s' -> (d, s)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise InvalidInputError(f"{flag} {text!r}: expected a worker as PIPELINE,STAGE (e.g. 1,2)")
    return int(parts[0]), int(parts[1])


def parse_slow(text: str) -> SlowWorker:
    """'d,s:factor' -> SlowWorker."""
    worker, sep, factor = text.partition(":")
    if not sep:
        raise InvalidInputError(f"--slow {text!r}: expected PIPELINE,STAGE:FACTOR (e.g. 0,4:1.5)")
    try:
        value = float(factor)
    except ValueError:
        raise InvalidInputError(f"--slow {text!r}: factor {factor!r} is not a number") from None
    try:
        return SlowWorker(worker=parse_worker(worker, "--slow"), factor=value)
    except ValidationError as exc:
        raise InvalidInputError(f"--slow {text!r}:\n{describe_validation_error(exc)}") from exc


def build_scenario(scenario_path: str | None, fails: list[str], slows: list[str]) -> FailureScenario:
    """The scenario from --scenario and/or --fail / --slow flags (flags add to the file)."""
    base = read_document(scenario_path, FailureScenario, "failure scenario") if scenario_path else None
    failed = list(base.failed) if base else []
    slow = list(base.slow) if base else []
    failed += [parse_worker(f, "--fail") for f in fails]
    slow += [parse_slow(s) for s in slows]
    try:
        return FailureScenario(failed=failed, slow=slow)
    except ValidationError as exc:
        raise InvalidInputError(f"failure scenario:\n{describe_validation_error(exc)}") from exc


class Once(argparse.Action):
    """A flag that may be given once: a second one is an error (argparse's default keeps the last,
    silently dropping the first, e.g. one of two --scenario files)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) not in (None, self.default):
            parser.error(f"{option} given twice; give it once")
        setattr(namespace, self.dest, values)


PICTURE_SUFFIXES = (".png", ".svg")


def check_output(path: str | None, flag: str, suffixes: tuple[str, ...] | None = None) -> None:
    """Fail early (InvalidInputError, exit 2) when `path` cannot be written, before any work is done.

    Missing parent directories are fine (write_output creates them) as long as the nearest existing
    ancestor is a writable directory. `suffixes`: the only accepted file suffixes (case-insensitive).
    """
    if not path:
        return
    p = Path(path)
    if suffixes is not None and p.suffix.lower() not in suffixes:
        raise InvalidInputError(
            f"{flag} {path}: unsupported file type {p.suffix or '(no suffix)'}; use {' or '.join(suffixes)}"
        )
    if p.is_dir():
        raise InvalidInputError(f"{flag} {path}: is a directory")
    if p.exists() and not _writable_file(p):
        raise InvalidInputError(f"{flag} {path}: file exists and is not writable")
    ancestor = p.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InvalidInputError(f"{flag} {path}: cannot create a directory under {ancestor}: it is a file")
    if not writable_dir(ancestor):
        raise InvalidInputError(f"{flag} {path}: directory {ancestor} is not writable")


def _writable_file(path: Path) -> bool:
    """Whether `path` (which exists) can be written: a regular file is opened for appending (root
    passes os.access on read-only files such as /proc's); anything else (a device, a pipe, which an
    open could block on) by os.access."""
    if not path.is_file():
        return os.access(path, os.W_OK)
    try:
        with open(path, "ab"):
            return True
    except OSError:
        return False


def writable_dir(path: Path) -> bool:
    """Whether a file can be created in directory `path`: a nameless temporary file is made and
    dropped (os.access says yes to root on /proc, /sys and read-only mounts)."""
    if not os.access(path, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def check_output_dir(path: str | None, flag: str) -> None:
    """Like check_output, for a directory that is created if missing (e.g. a plan cache)."""
    if not path:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InvalidInputError(f"{flag} {path}: exists and is not a directory")
    check_output(str(p / "x"), flag)


def make_parent(path: str | Path, flag: str) -> Path:
    """Create the parent directories of an output file; InvalidInputError names the flag on failure."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidInputError(f"{flag} {path}: cannot create {p.parent}: {exc.strerror or exc}") from exc
    return p


def write_output(path: str, text: str, flag: str) -> None:
    """Write `text` to `path` (parents created); InvalidInputError names the flag on failure."""
    p = make_parent(path, flag)
    try:
        p.write_text(text)
    except OSError as exc:
        raise InvalidInputError(f"{flag} {path}: cannot write: {exc.strerror or exc}") from exc


MAX_FLAG_VALUE = 1e12  # seconds: 31,000 years, well inside a timedelta


def finite_float(text: str) -> float:
    """argparse type of every float flag: a finite number of size at most MAX_FLAG_VALUE (NaN,
    infinity and e.g. 1e300 are refused, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if abs(value) > MAX_FLAG_VALUE:  # e.g. --time-limit 1e300 overflowed a timedelta after workers started
        raise argparse.ArgumentTypeError(f"{text!r} is out of range (at most {MAX_FLAG_VALUE:g} in size)")
    return value
