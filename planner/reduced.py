"""Planning on a reduced grid: the touched pipelines, the peers that take their work, one stand-in.

A failure set touches at most a few pipelines; on llama3-405b-p16d128 (128 pipelines) the rest are
identical. The planner plans a job cut to D' pipelines, numbered as the canonical scenario numbers
them (touched pipelines first):

- pipelines 0..T-1: touched (they lost workers);
- pipelines T..D'-2: untouched peers that take the re-routed micro-batches (at most one extra each
  per stage: see `reduced_pipelines`);
- pipeline D'-1: the stand-in, which hosts exactly its own micro-batches at every stage.

The full schedule gives pipelines D'..D-1 the stand-in's orders (its micro-batch ids renamed to
their own pipeline). Why the full replay equals the reduced one (docs/planner.md, "Reduced grid"):
a copy's ops depend only on ops of its own pipeline (F/B hops), on its own order, and on its
stage's OPT condition (the latest W/BW of every alive peer plus the all-reduce). By induction over
the replay's topological order every copy's start and end equal the stand-in's, so the latest W of
each stage, every OPT and therefore every time of the kept workers are unchanged. plan() still
validates the full schedule with the referee, which would reject a broken argument ('claim').

What it costs: the stage bounds depend only on how many micro-batches the busiest peer hosts. D' is
the least number of pipelines whose balanced allocation gives every stage the busiest count of the
full grid while the stand-in takes no extra; so the load and memory-aware bounds of the reduced job
equal the full job's (checked below), and nothing is lost against either bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.bounds import allocate_stage
from planner.contract import Action, FailureScenario, JobSpec, Schedule, WorkerSchedule
from planner.problem import Problem


@dataclass(frozen=True)
class Reduced:
    """A job cut to `num_pipelines` pipelines whose last one (the stand-in) stands for the rest."""

    job: JobSpec
    num_pipelines: int
    full_pipelines: int

    @property
    def stand_in(self) -> int:
        return self.num_pipelines - 1


def _busiest(
    job: JobSpec, scenario: FailureScenario, prefer: list[int] | None = None
) -> list[dict[int, int]]:
    return [allocate_stage(job, scenario, s, prefer).counts for s in range(job.num_stages)]


def reduced_pipelines(job: JobSpec, scenario: FailureScenario) -> int | None:
    """Least D' (touched pipelines first, stand-in last) with the full grid's busiest counts and a
    stand-in that hosts only its own micro-batches; None when the reduction does not apply (slow
    workers, touched pipelines not numbered first) or saves nothing."""
    if scenario.slow:
        return None
    touched = sorted({d for d, _ in scenario.failed})
    if touched != list(range(len(touched))):
        return None
    num_d, num_m = job.num_pipelines, job.num_microbatches
    lost: dict[int, int] = {}
    for _, s in scenario.failed:
        lost[s] = lost.get(s, 0) + 1
    # Each stage's k lost workers' k*M micro-batches go one each to k*M peers of the reduced grid;
    # where failures sit at several stages, to peers that take none at another stage (`disjoint`).
    start = max([len(touched) + 1] + [k * (num_m + 1) + 1 for k in lost.values()])
    if len(lost) > 1:
        start = max(start, len(touched) + num_m * sum(lost.values()) + 1)
    # Identical peers: the full grid's busiest worker of stage s hosts ceil(D*M / alive_s).
    full = [-(-num_d * num_m // (num_d - lost.get(s, 0))) for s in range(job.num_stages)]
    for size in range(start, min(start + 4, num_d)):
        small = job.model_copy(update={"num_pipelines": size})
        counts = _busiest(small, scenario, prefer=list(range(size)))
        if all(max(c.values()) == f and c[size - 1] == num_m for c, f in zip(counts, full, strict=True)):
            return size
    return None


def reduce_job(job: JobSpec, scenario: FailureScenario) -> Reduced | None:
    """The reduced job for the canonical `scenario`, or None (see `reduced_pipelines`)."""
    size = reduced_pipelines(job, scenario)
    if size is None:
        return None
    return Reduced(
        job=job.model_copy(update={"num_pipelines": size}),
        num_pipelines=size,
        full_pipelines=job.num_pipelines,
    )


def host_variants(red: Reduced, scenario: FailureScenario) -> list[Problem]:
    """Balanced host maps of the reduced job in which the stand-in hosts only its own micro-batches:
    extras on disjoint untouched peers per failed stage (`disjoint`), preferred on the untouched
    peers first, or on the touched pipelines first."""
    size, touched = red.num_pipelines, sorted({d for d, _ in scenario.failed})
    peers = [d for d in range(size - 1) if d not in touched]
    candidates = [disjoint(red, scenario)]
    for prefer in (peers + touched + [size - 1], touched + peers + [size - 1]):
        candidates.append(Problem.build(red.job, scenario, prefer=prefer))
    problems: list[Problem] = []
    for prob in candidates:
        if stand_in_own(red, prob) and all(prob.host != other.host for other in problems):
            problems.append(prob)
    return problems


def disjoint(red: Reduced, scenario: FailureScenario) -> Problem:
    """The balanced host map whose untouched peers take extras at one failed stage at most.

    A peer that hosts a re-routed micro-batch runs one more F in its warm-up, where its own Fs
    arrive about one F apart: its own stream falls an F behind, at every stage where it takes one.
    On llama3-405b-p16d128 with failures at stages 1, 2 and 3 the same 16 peers took the extras of
    all three, and their last stage started its F+B pairs three Fs late (docs/benchmarks.md, llama3).
    Stage s's k_s*M extras go to the next k_s*M peers (`reduced_pipelines` keeps enough of them).
    """
    size, touched = red.num_pipelines, sorted({d for d, _ in scenario.failed})
    peers = [d for d in range(size - 1) if d not in touched]
    lost: dict[int, int] = {}
    for _, s in scenario.failed:
        lost[s] = lost.get(s, 0) + 1
    prob = Problem.build(red.job, scenario, prefer=peers + touched + [size - 1])
    taken = 0
    for s in sorted(lost):
        block = peers[taken : taken + lost[s] * red.job.num_microbatches]
        taken += len(block)
        rest = [d for d in peers if d not in block]
        stage = Problem.build(red.job, scenario, prefer=block + rest + touched + [size - 1])
        prob.host.update({key: h for key, h in stage.host.items() if key[0] == s})
    return prob


def stand_in_own(red: Reduced, problem: Problem) -> bool:
    """Whether the stand-in hosts exactly its own micro-batches at every stage of `problem`."""
    return all(h == d for (_, d, _), h in problem.host.items() if red.stand_in in (d, h))


def expand(red: Reduced, schedule: Schedule) -> Schedule:
    """The full-grid schedule: the reduced schedule plus the stand-in's worker schedules copied to
    pipelines D'..D-1 (micro-batch ids renamed), times included (equal by the module's argument)."""
    workers = list(schedule.workers)
    for ws in schedule.workers:
        if ws.worker[0] != red.stand_in:
            continue
        for d in range(red.num_pipelines, red.full_pipelines):
            actions = [
                Action.model_construct(
                    op=a.op, mb=None if a.mb is None else (d, a.mb[1]), start_ms=a.start_ms, end_ms=a.end_ms
                )
                for a in ws.actions
            ]
            workers.append(WorkerSchedule.model_construct(worker=(d, ws.worker[1]), actions=actions))
    workers.sort(key=lambda w: (w.worker[1], w.worker[0]))
    return schedule.model_copy(update={"workers": workers})
