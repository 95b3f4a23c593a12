"""Normalized failure sets up to k failures, and how many physical placements each stands for.

A canonical scenario is a multiset of per-pipeline failed-stage sets (planner.normalize's key,
without slow workers). With j pipelines touched and c_i copies of each distinct set, it stands for
D! / ((D - j)! * prod c_i!) physical failure sets; the counts over all canonical scenarios with k
failures add up to C(D*P, k), which the tests check.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from planner.contract import FailureScenario, JobSpec
from planner.normalize import normalize

StageSet = tuple[int, ...]


@dataclass(frozen=True)
class Canonical:
    """One normalized scenario with k failures and its number of physical placements."""

    scenario: FailureScenario
    key: str
    placements: int


def _stage_sets(num_stages: int, max_size: int) -> list[StageSet]:
    out: list[StageSet] = []
    for size in range(1, max_size + 1):
        out.extend(itertools.combinations(range(num_stages), size))
    return out


def _multisets(sets: list[StageSet], start: int, budget: int, slots: int) -> Iterator[list[StageSet]]:
    if budget == 0:
        yield []
        return
    if slots == 0:
        return
    for i in range(start, len(sets)):
        if len(sets[i]) <= budget:
            for rest in _multisets(sets, i, budget - len(sets[i]), slots - 1):
                yield [sets[i], *rest]


def placements(job: JobSpec, groups: list[StageSet]) -> int:
    """Physical failure sets that normalize to the multiset `groups` of per-pipeline stage sets."""
    d, j = job.num_pipelines, len(groups)
    count = math.perm(d, j)
    for c in Counter(groups).values():
        count //= math.factorial(c)
    return count


def canonical_scenarios(job: JobSpec, num_failures: int) -> Iterator[Canonical]:
    """Every normalized scenario with exactly `num_failures` failed workers (slow: none)."""
    sets = _stage_sets(job.num_stages, num_failures)
    for groups in _multisets(sets, 0, num_failures, job.num_pipelines):
        failed = [(c, s) for c, stages in enumerate(groups) for s in stages]
        scenario = FailureScenario(failed=failed)
        norm = normalize(job, scenario)
        yield Canonical(norm.scenario, norm.key, placements(job, groups))


def count_canonical(job: JobSpec, num_failures: int) -> int:
    """How many normalized scenarios have exactly `num_failures` failures."""
    sets = _stage_sets(job.num_stages, num_failures)
    return sum(1 for _ in _multisets(sets, 0, num_failures, job.num_pipelines))


def sample_scenarios(job: JobSpec, num_failures: int, num_samples: int, seed: int) -> list[Canonical]:
    """`num_samples` physical placements drawn uniformly (seeded), as canonical scenarios with
    weight 1 each (duplicates kept, so averages stay averages over placements)."""
    rng = random.Random(seed)
    workers = [(d, s) for d in range(job.num_pipelines) for s in range(job.num_stages)]
    out = []
    for _ in range(num_samples):
        norm = normalize(job, FailureScenario(failed=rng.sample(workers, num_failures)))
        out.append(Canonical(norm.scenario, norm.key, 1))
    return out


def scenarios_for(
    job: JobSpec, num_failures: int, max_scenarios: int, seed: int
) -> tuple[list[Canonical], bool]:
    """All canonical scenarios when there are at most `max_scenarios`, else a uniform sample of
    physical placements. Returns (scenarios, exhaustive)."""
    if count_canonical(job, num_failures) <= max_scenarios:
        return list(canonical_scenarios(job, num_failures)), True
    return sample_scenarios(job, num_failures, max_scenarios, seed + num_failures), False
