"""Request and response bodies of the HTTP API (the wire documents themselves are planner.contract's).

Request fields are strict: `"2"` is no integer and `"yes"` no boolean (pydantic's lax mode took both);
an integer is a number.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from planner.contract import FailureScenario, JobSpec, Worker

JobState = Literal["running", "needs_restore", "finished"]
RestorePolicy = Literal["auto", "manual"]


class RestoreInfo(BaseModel):
    """The latest restore: carried by every version from the first restore on (docs/service.md)."""

    epoch: int = Field(ge=1, description="Restore epoch: 1 for the first restore, +1 for each later one.")
    iteration: int | None = Field(
        ge=0,
        description="The stepped count of the checkpoint every worker loads; null: no complete checkpoint "
        "was reported, start from the initial parameters with a fresh optimizer.",
    )


class JobCreate(BaseModel):
    """POST /v1/jobs body."""

    model_config = ConfigDict(extra="forbid")

    job: JobSpec = Field(description="The job spec (CONTRACT.md section 1).")
    max_failures: StrictInt = Field(
        default=2, ge=0, description="Precompute plans for up to this many failures."
    )
    heartbeat_enabled: StrictBool = Field(default=True, description="Declare silent workers failed.")
    heartbeat_timeout_s: StrictFloat | None = Field(
        default=None,
        ge=0.1,
        le=86400,
        description="Silence that fails a worker, 0.1 s to a day; default from settings.",
    )
    restore_policy: RestorePolicy = Field(
        default="auto",
        description="auto: an event that loses a whole stage publishes the needs_restore version and at once "
        "a restore version (every worker alive, `restore` {epoch, iteration}); manual: the job stays "
        "needs_restore until rejoin events bring every stage back.",
    )
    repartition: StrictBool = Field(
        default=False,
        description="true: every failure set's plan also chooses which contiguous layers each stage holds "
        "(issue 12: layers move off the stages that lost workers); its schedule then carries `partition` "
        "and `migration`, and so does every worker's view. Needs per-layer figures in the job spec "
        "(`layers`, or `model.layers`). false (default): re-route only.",
    )


class JobPatch(BaseModel):
    """PATCH /v1/jobs/{id} body: controller switches."""

    model_config = ConfigDict(extra="forbid")

    heartbeat_enabled: StrictBool | None = Field(
        default=None, description="Turn heartbeat failure on or off."
    )
    heartbeat_timeout_s: StrictFloat | None = Field(
        default=None, ge=0.1, le=86400, description="New timeout."
    )


class JobCreated(BaseModel):
    """POST /v1/jobs answer. The worker token is shown only here."""

    id: str
    worker_token: str = Field(description="Bearer token for this job's workers (GET schedule only).")
    version: int
    state: str
    warnings: list[str] = Field(
        default_factory=list,
        description="Fields of the job spec that recycle does not read, ignored (a misspelt "
        "field, e.g. `failed_workers` for `failed`), each with the closest known name.",
    )


class Precompute(BaseModel):
    total: int
    done: int = Field(description="Keys planned, or given up after a failed solve (those count in `failed`).")
    failed: int = Field(
        default=0,
        description="Keys whose solve failed in this run of the service (a killed solver process, Ray "
        "retries spent): they are not stored, an event on them gets a greedy plan, the next start retries "
        "them.",
    )


class JobStatus(BaseModel):
    """GET /v1/jobs/{id} answer."""

    id: str
    name: str
    state: JobState = Field(
        description="running; needs_restore (a whole stage lost); finished (every alive worker is done)."
    )
    failed: list[Worker]
    slow: list[dict[str, Any]]
    version: int
    source: str | None = Field(description="Who made the current schedule: precomputed, greedy, cpsat.")
    iteration_time_ms: float | None
    unrecoverable_stages: list[int]
    max_failures: int
    heartbeat_enabled: bool
    heartbeat_timeout_s: float
    precompute: Precompute
    created_at: float
    done: list[Worker] = Field(
        default_factory=list, description="Alive workers that reported `done` (completed their iterations)."
    )
    poll_wait_max_s: float | None = Field(
        default=None,
        description="Longest wait a worker's heartbeat poll is granted now (RECYCLE_MAX_WAIT_S, and "
        "heartbeat_timeout_s / 3 while heartbeats are on); also the Recycle-Poll-Wait-Max header of a poll.",
    )
    restore_policy: RestorePolicy = Field(default="auto", description="auto or manual (see JobCreate).")
    repartition: bool = Field(default=False, description="Plans choose the layer split too (see JobCreate).")
    restore: RestoreInfo | None = Field(
        default=None, description="The latest restore; null before the first."
    )
    checkpoints: dict[str, list[int]] = Field(
        default_factory=dict,
        description="Per stage (key: the stage as a string), the newest reported checkpoint iterations.",
    )
    restorable_iteration: int | None = Field(
        default=None, description="The newest iteration every stage reported a checkpoint for; null if none."
    )
    job: JobSpec | None = Field(
        default=None,
        description="The registered job spec (an agent reads its grid and stage figures from here).",
    )


class JobSummary(BaseModel):
    """One job in GET /v1/jobs."""

    id: str
    name: str
    created_at: float = Field(description="Registration time, seconds since the epoch.")
    state: JobState
    version: int
    num_pipelines: int = Field(description="D")
    num_stages: int = Field(description="P")
    failed: list[Worker] = Field(description="The failed workers [d, s] of the current version.")


class JobList(BaseModel):
    """GET /v1/jobs answer: newest first."""

    jobs: list[JobSummary]
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next (older) page; null on the last page."
    )


class EventIn(BaseModel):
    """POST /v1/jobs/{id}/events body. Idempotent by event_id."""

    model_config = ConfigDict(extra="forbid")

    event_id: str = Field(min_length=1, max_length=200, description="Client-chosen id; replays are no-ops.")
    kind: Literal["fail", "rejoin", "slow", "done", "checkpoint"] = Field(
        description="fail, rejoin, slow (with factor), done (these workers completed their iterations "
        "and stop polling; the job is finished once every alive worker is done), or checkpoint (with "
        "iteration: the stages of these workers have a durable checkpoint at that stepped count; makes no "
        "version). The controller token and the job's worker token may post every kind."
    )
    workers: list[Worker] = Field(min_length=1, max_length=4096, description="Workers [d, s] concerned.")
    factor: StrictFloat | None = Field(
        default=None, gt=0, le=1000, description="For slow: the new factor; 1.0 clears slowness."
    )
    reason: str | None = Field(default=None, max_length=1000, description="Free text for the history.")
    iteration: StrictInt | None = Field(
        default=None, ge=0, le=2**53, description="For checkpoint: the stepped count of the checkpoint."
    )

    @model_validator(mode="after")
    def _check_factor(self) -> EventIn:
        if self.kind == "slow" and self.factor is None:
            raise ValueError("kind 'slow' needs factor")
        if self.kind != "slow" and self.factor is not None:
            raise ValueError(f"kind {self.kind!r} takes no factor")
        if self.kind == "checkpoint" and self.iteration is None:
            raise ValueError("kind 'checkpoint' needs iteration")
        if self.kind != "checkpoint" and self.iteration is not None:
            raise ValueError(f"kind {self.kind!r} takes no iteration")
        return self

    def body_json(self) -> str:
        """The body as stored for replay comparison (`iteration` only when given, so that events stored
        before the field existed compare equal)."""
        return self.model_dump_json(exclude={"iteration"} if self.iteration is None else None)


class EventResult(BaseModel):
    """POST /v1/jobs/{id}/events answer."""

    event_id: str
    job_id: str
    version: int
    state: str = Field(description="The job's state after the event: running, needs_restore or finished.")
    source: str | None
    failed: list[Worker]
    changed: bool = Field(
        description="False when the event did not change the failure set (always for `done`)."
    )
    replayed: bool = Field(default=False, description="True when this event_id was already applied.")
    unrecoverable_stages: list[int] | None = Field(
        default=None, description="The stages the event lost (with restore policy auto: restored at once)."
    )
    needs_restore_version: int | None = Field(
        default=None,
        description="Restore policy auto: the needs_restore version committed before the restore version "
        "(`version`).",
    )
    restore: RestoreInfo | None = Field(
        default=None, description="Restore policy auto: the restore this event caused (epoch, iteration)."
    )
    restorable_iteration: int | None = Field(
        default=None, description="checkpoint events: the job's restorable iteration after this report."
    )


class PlanRequest(BaseModel):
    """POST /v1/plan body: a stateless what-if."""

    model_config = ConfigDict(extra="forbid")

    job: JobSpec
    scenario: FailureScenario = Field(default_factory=FailureScenario)
    time_limit_s: StrictFloat | None = Field(
        default=None, gt=0, description="Capped by the service settings."
    )
    use_cpsat: StrictBool = True
    repartition: StrictBool = Field(
        default=False,
        description="Choose the layer split too (as a job registered with `repartition: true`); the figures "
        "then carry a `repartition` block. Up to three candidate plans, each within the time limit.",
    )


class PlanResponse(BaseModel):
    schedule: dict[str, Any]
    figures: dict[str, Any]
    warnings: list[str] = Field(
        default_factory=list,
        description="Fields of the job spec and the scenario that recycle does not read, ignored (a misspelt "
        "field, e.g. `failed_workers` for `failed`), each with the closest known name.",
    )


class ScheduleEnvelope(BaseModel):
    """GET /v1/jobs/{id}/schedule answer without `worker` (documentation model)."""

    job_id: str
    version: int
    state: str
    source: str
    restore_policy: RestorePolicy
    restore: RestoreInfo | None = Field(default=None, description="Absent before the first restore.")
    joined_at: dict[str, int] = Field(
        default_factory=dict,
        description='{"d,s": the version since which that alive worker is continuously alive}',
    )
    schedule: dict[str, Any]


class WorkerView(BaseModel):
    """GET /v1/jobs/{id}/schedule?worker=d,s answer (documentation model)."""

    job_id: str
    version: int
    state: str
    worker: Worker
    alive: bool
    iteration_time_ms: float
    failed: list[Worker] = Field(description="The version's failed workers (its schedule's `failed`).")
    stage_alive: list[Worker] = Field(description="Alive workers of this stage (its OPT all-reduce group).")
    routes: list[dict[str, Any]] = Field(
        description="Per hosted micro-batch: prev_host (stage s-1) and next_host (stage s+1)."
    )
    actions: list[dict[str, Any]]
    restore_policy: RestorePolicy = Field(
        description="auto: a needs_restore version is followed by a restore version (wait for it)."
    )
    restore: RestoreInfo | None = Field(default=None, description="Absent before the first restore.")
    partition: list[list[int]] | None = Field(
        default=None,
        description="The layer range [first, end) each stage holds, the same in every pipeline; absent: "
        "the job's own split (only a job registered with `repartition: true` moves layers).",
    )
    migration: dict[str, Any] | None = Field(
        default=None, description="With `partition`: the plan's layer moves and `estimated_ms`."
    )
    joined_at: int | None = Field(
        default=None,
        description="Alive workers: the version since which this worker is continuously alive (fencing).",
    )
