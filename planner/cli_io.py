"""Reading the CLI's input documents with errors a user can act on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from planner.contract import FailureScenario, SlowWorker
from planner.errors import InvalidInputError

Doc = TypeVar("Doc", bound=BaseModel)


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the field path."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(document)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)


def read_document(path: str, model: type[Doc], what: str) -> Doc:
    """Parse `path` as JSON into `model`; InvalidInputError names the file and the field."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise InvalidInputError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(
            f"{what} {path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidInputError(
            f"{what} {path} is not a valid {what}:\n{describe_validation_error(exc)}"
        ) from exc


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
