"""Where `recycle launch --schedules DIR` gets the schedule of each failure set.

Two kinds of directory, both checked against the launch's job before any process starts
(`open_schedules`; InvalidInputError, exit 2):

- a plan directory written by `recycle precompute JOB -o DIR`: hash-named plans of the normalized
  failure sets plus `index-<job fingerprint>.json` (whatif/cache.py). A missing index for this job
  means the plans are for another job spec (or precompute was interrupted). A failure set is
  normalized (planner/normalize.py: pipelines relabelled so that equal failure patterns share one
  plan), its plan read, and mapped back onto the physical pipelines (`to_physical`).
- hand-made schedules named `failed-none.json`, `failed-1.1.json`, `failed-0.2-1.1.json` (the
  failed workers as d.s, sorted), e.g. from `recycle plan JOB --fail 1,1 -o failed-1.1.json`. Every
  such file is checked against the job up front.

The failure-free schedule of either kind must pass the structure rules of docs/contract.md
section 3 for this job. A failure set without a plan raises PublisherError when it happens (the
launch stops with a message naming the set and how to precompute it), unless `plan_on_demand`
(`recycle launch --plan-on-demand`): then the directory may be new or hold only some plans, and a
missing plan is made when its failure set happens (greedy planner, whatif.strategies.recycle) and
added to the directory; this imports the planner into the launcher.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import InvalidInputError, ScheduleRuleError
from planner.normalize import job_fingerprint, normalize, to_physical
from planner.simulator.structure import check_structure
from runtime_adapter.assignment import Worker
from runtime_adapter.publishers import PublisherError
from whatif.cache import INDEX_FORMAT, index_name

Failed = frozenset[Worker]


def schedule_file_name(failed: Failed) -> str:
    """File name of the hand-made schedule for a failure set (`failed-none.json`, `failed-1.1.json`)."""
    if not failed:
        return "failed-none.json"
    return "failed-" + "-".join(f"{d}.{s}" for d, s in sorted(failed)) + ".json"


def _parse_name(name: str) -> Failed | None:
    """The failure set a `failed-*.json` name stands for (None: not such a name)."""
    if not (name.startswith("failed-") and name.endswith(".json")):
        return None
    body = name[len("failed-") : -len(".json")]
    if body == "none":
        return frozenset()
    out = set()
    for part in body.split("-"):
        d, dot, s = part.partition(".")
        if not (dot and d.isdigit() and s.isdigit()):
            return None
        out.add((int(d), int(s)))
    return frozenset(out)


def _check(job: JobSpec, failed: Failed, schedule: Schedule, where: str) -> None:
    try:
        check_structure(job, FailureScenario(failed=sorted(failed)), schedule)
    except ScheduleRuleError as e:
        raise InvalidInputError(f"{where} does not fit job {job.name!r}: {e}") from e


class PlanDirectory:
    """The plans `recycle precompute` wrote for this job (see the module docstring). With
    `plan_on_demand`, a failure set without a plan is planned when it happens (greedy, a few seconds
    at most, in the launcher's supervision loop) and its plan added to the directory."""

    def __init__(
        self, directory: Path, job: JobSpec, max_failures: int, plan_on_demand: bool = False
    ) -> None:
        self.directory, self.job = directory, job
        self.max_failures, self.plan_on_demand = max_failures, plan_on_demand

    def _plan(self, scenario: FailureScenario) -> dict[str, Any]:
        from whatif.cache import PlanCache
        from whatif.strategies.recycle import plan_record

        record = plan_record(self.job, scenario)
        PlanCache(self.directory).put(record["key"], record)
        return record

    def __call__(self, failed: Failed) -> Schedule:
        """The schedule for the physical failure set `failed`."""
        scenario = FailureScenario(failed=sorted(failed))
        norm = normalize(self.job, scenario)
        path = self.directory / f"{norm.key}.json"
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            if self.plan_on_demand:
                record = self._plan(scenario)
            else:
                raise PublisherError(
                    f"no precomputed plan for failed {[list(w) for w in sorted(failed)]}: "
                    f"{self.directory} covers up to {self.max_failures} failures "
                    f"(recycle precompute --max-failures {len(failed)}, or launch --plan-on-demand)"
                ) from None
        except (OSError, ValueError) as e:
            raise PublisherError(f"unreadable plan {path}: {e}") from e
        if record.get("unrecoverable"):
            raise PublisherError(
                f"failed {sorted(failed)} is unrecoverable (stages {record.get('stages')} lost)"
            )
        if "schedule" not in record:
            raise PublisherError(f"{path} holds figures but no schedule: delete it and run precompute again")
        return to_physical(Schedule.model_validate(record["schedule"]), norm, scenario)

    def describe(self) -> str:
        """One line for the launch's start-up report."""
        on_demand = ", the others planned when they happen" if self.plan_on_demand else ""
        if self.max_failures < 0:
            return f"{self.directory} (planned when they happen)"
        return f"{self.directory} (precomputed, up to {self.max_failures} failures{on_demand})"


class NamedSchedules:
    """Hand-made schedules named failed-<d.s>-....json (see the module docstring)."""

    def __init__(self, directory: Path, job: JobSpec) -> None:
        self.directory, self.job = directory, job
        self.sets = sorted(
            (f for f in (_parse_name(p.name) for p in directory.glob("failed-*.json")) if f is not None),
            key=lambda f: (len(f), sorted(f)),
        )

    def __call__(self, failed: Failed) -> Schedule:
        """The schedule in failed-....json for `failed`."""
        path = self.directory / schedule_file_name(failed)
        try:
            return Schedule.model_validate_json(path.read_text())
        except (OSError, ValueError) as e:
            raise PublisherError(f"no usable schedule for failed {sorted(failed)}: {path}: {e}") from e

    def check_all(self) -> None:
        """Every failed-*.json file must fit the job (InvalidInputError otherwise)."""
        for failed in self.sets:
            path = self.directory / schedule_file_name(failed)
            try:
                schedule = Schedule.model_validate_json(path.read_text())
            except (OSError, ValueError) as e:
                raise InvalidInputError(f"--schedules: {path} is not a valid schedule: {e}") from e
            _check(self.job, failed, schedule, f"--schedules: {path}")

    def describe(self) -> str:
        """One line for the launch's start-up report."""
        return f"{self.directory} ({len(self.sets)} named schedules)"


ScheduleDirectory = PlanDirectory | NamedSchedules


def _read_index(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != INDEX_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {INDEX_FORMAT!r}")
        int(doc["max_failures"])
        return dict(doc)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidInputError(f"--schedules: unreadable plan index {path}: {e}") from e


def _other_jobs(directory: Path) -> list[str]:
    out = []
    for path in sorted(directory.glob("index-*.json")):
        try:
            job = json.loads(path.read_text())["job"]
            out.append(
                f"{job['name']!r} ({job['num_pipelines']} x {job['num_stages']}, M={job['num_microbatches']})"
            )
        except (OSError, ValueError, KeyError, TypeError):
            out.append(path.name)
    return out


def open_schedules(path: str, job: JobSpec, plan_on_demand: bool = False) -> ScheduleDirectory:
    """The schedules of --schedules `path` for `job`, checked (InvalidInputError: exit 2). With
    `plan_on_demand` the directory may be new or empty: the plans are then made when needed."""
    directory = Path(path)
    index = directory / index_name(job)
    if directory.exists() and not directory.is_dir():
        raise InvalidInputError(f"--schedules {path}: not a directory")
    if plan_on_demand and not (directory / schedule_file_name(frozenset())).is_file():
        directory.mkdir(parents=True, exist_ok=True)
        prior = _read_index(index)["max_failures"] if index.is_file() else -1
        source: ScheduleDirectory = PlanDirectory(directory, job, int(prior), plan_on_demand=True)
        return _checked(source, job, path)
    if not directory.is_dir():
        raise InvalidInputError(
            f"--schedules {path}: not a directory (make one with `recycle precompute JOB -o {path}`)"
        )
    if index.is_file():
        source = PlanDirectory(directory, job, int(_read_index(index)["max_failures"]))
        return _checked(source, job, path)
    if (directory / schedule_file_name(frozenset())).is_file():
        source = NamedSchedules(directory, job)
        source.check_all()
        return source
    if others := _other_jobs(directory):
        raise InvalidInputError(
            f"--schedules {path} holds plans of another job spec ({', '.join(others)}; this launch: "
            f"{job.name!r} ({job.num_pipelines} x {job.num_stages}, M={job.num_microbatches}), fingerprint "
            f"{job_fingerprint(job)}): run `recycle precompute JOB -o {path}` with this job spec"
        )
    hashed = [p for p in directory.glob("*.json") if not p.name.startswith(("failed-", "index-"))]
    hint = " (an interrupted precompute? run it again: it resumes)" if hashed else ""
    raise InvalidInputError(
        f"--schedules {path}: no plan index for this job{hint}: write one with "
        f"`recycle precompute JOB --max-failures K -o {path}` "
        "(or put hand-made failed-none.json, failed-D.S.json there, or add --plan-on-demand)"
    )


def _checked(source: ScheduleDirectory, job: JobSpec, path: str) -> ScheduleDirectory:
    """`source` once its failure-free schedule passed the structure rules for `job`."""
    try:
        schedule = source(frozenset())
    except PublisherError as e:
        raise InvalidInputError(f"--schedules {path}: {e}") from e
    _check(job, frozenset(), schedule, f"--schedules {path}: the failure-free plan")
    return source
