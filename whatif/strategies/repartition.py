"""recycle+repartition (issue 12): re-route AND move layers off the stages that lost workers.

The grid stays (every survivor keeps its pipeline and stage); planner.partition chooses which
contiguous layers each stage holds, the same in every pipeline, then the re-routed schedule for
that split (planner/partition/choose.py); a stage left few survivors may hand all its layers to
its neighbours. Exact (the default): planned, greedy only, the record kept in the plan cache under
`repartition/` (records carry RECORD_VERSION; older ones are re-done). Not exact (`recycle
simulate` without --exact): the memory-aware bound of the best candidate split, or of the job's
own when that is no worse, labelled `estimated` (the same estimate recycle takes,
whatif/estimate.py).

Each change of the failure set stalls reroute_s plus the migration to the new split: the MiB of
parameters and optimizer state of every layer whose stage changes (relative to the split in effect
before the change) over the link bandwidth (comm.migration_mib_per_ms, else derived; see
planner/partition/layers.py). `switch_s` is read by whatif.events right after the strategy was
asked about the new failure set, so the split in effect is the last one asked about.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from planner.bounds import memory_bound
from planner.contract import FailureScenario, JobSpec
from planner.errors import InvalidInputError
from planner.normalize import normalize
from planner.partition.derive import derive_job, migration
from planner.partition.layers import layer_model
from whatif.cache import PlanCache
from whatif.strategies.base import Costs, Outcome, Strategy, lost_stages

KIND = "repartition"
RECORD_VERSION = 4  # 2: a stage may hold no layer; 3: derived layers keep embedding and head;
# 4: no failure keeps the job's own partition


def repartition_record(
    job: JobSpec, scenario: FailureScenario, exact: bool, time_limit: timedelta
) -> dict[str, Any]:
    """The cache record of `scenario` (canonical form): iteration time, partition, migration.
    Without a failure the job keeps its own partition: the strategy moves layers in answer to
    failures, not to rebalance the job's own split (which would beat the failure-free run)."""
    scenario.check_grid(job)
    if not scenario.failed:
        return _own_partition_record(job, scenario, exact, time_limit)
    if exact:
        from planner.partition.choose import plan_repartition

        rep = plan_repartition(job, scenario, time_limit=time_limit, use_cpsat=False)
        return {
            "iteration_time_ms": rep.iteration_time_ms,
            "reroute_only_ms": None if rep.reroute is None else rep.reroute.iteration_time_ms,
            "partition": rep.partition,
            "load_bound_ms": rep.load_bound_ms,
            "best_load_bound_ms": rep.best_load_bound_ms,
            "migration_ms": rep.migration.estimated_ms,
            "note": rep.note,
            "plan_s": rep.planning_s,
        }
    from planner.partition.choose import candidate_partitions

    model = layer_model(job)
    best, _, cands = candidate_partitions(job, scenario, model)
    own_ms = memory_bound(job, scenario)
    ms, part = own_ms, model.partition
    if cands:
        cand_ms = memory_bound(derive_job(job, cands[0], model), scenario)
        if cand_ms < own_ms:
            ms, part = cand_ms, cands[0]
    return {
        "iteration_time_ms": ms,
        "reroute_only_ms": own_ms,
        "partition": part,
        "best_load_bound_ms": best,
        "migration_ms": migration(job, part, model, scenario=scenario).estimated_ms,
        "estimated": True,
    }


def _own_partition_record(
    job: JobSpec, scenario: FailureScenario, exact: bool, time_limit: timedelta
) -> dict[str, Any]:
    if exact:
        from planner.plan import plan

        ms = plan(job, scenario, time_limit=time_limit, use_cpsat=False).iteration_time_ms
    else:
        ms = memory_bound(job, scenario)
    rec: dict[str, Any] = {
        "iteration_time_ms": ms,
        "reroute_only_ms": ms,
        "partition": layer_model(job).partition,
        "migration_ms": 0.0,
        "note": "no failure: the job's own partition",
    }
    if not exact:
        rec["estimated"] = True
    return rec


class RecycleRepartition(Strategy):
    """Re-routed schedules on a re-partitioned grid (planner.partition)."""

    name = "recycle+repartition"
    summary = "re-route + move layers to stages with more survivors; migration charged per change"

    def __init__(
        self,
        job: JobSpec,
        costs: Costs,
        cache: PlanCache | None = None,
        time_limit: timedelta = timedelta(seconds=3),
        exact: bool = True,
    ) -> None:
        super().__init__(job, costs)
        self.cache = cache or PlanCache(None)
        self.time_limit, self.exact = time_limit, exact
        self.model = layer_model(job)  # InvalidInputError when the job has no layer count
        self._active = self._last = self.model.partition
        self._last_scenario: FailureScenario | None = None
        self.migrations_ms: list[float] = []  # charged at each change, in order
        self._partitions: dict[str, list[list[int]]] = {}  # normalized key -> its split
        self.used: dict[str, dict[str, Any]] = {}  # normalized key -> the record the model used

    def evaluate(self, scenario: FailureScenario) -> Outcome:
        lost = lost_stages(self.job, scenario)
        if lost:
            return Outcome(None, f"stage(s) {lost} have no alive worker")
        key = normalize(self.job, scenario).key
        kind = KIND if self.exact else KIND + "-estimate"
        rec = self.cache.get(key, kind=kind)
        if rec is None or rec.get("version") != RECORD_VERSION:
            try:
                rec = repartition_record(self.job, scenario, self.exact, self.time_limit)
            except InvalidInputError as exc:
                rec = {"fatal": str(exc)}
            rec["version"] = RECORD_VERSION
            self.cache.put(key, rec, kind=kind)
        self.used[key] = {**rec, "scenario": scenario.model_dump(mode="json")}
        if "fatal" in rec:
            return Outcome(None, str(rec["fatal"]))
        self._partitions[key] = [list(r) for r in rec["partition"]]
        return Outcome(float(rec["iteration_time_ms"]), f"partition {rec['partition']}")

    def outcome(self, scenario: FailureScenario) -> Outcome:
        """Memoized as every strategy; also remembers the split of the set asked about last."""
        out = super().outcome(scenario)
        if not out.fatal:
            self._last = self._partitions[normalize(self.job, scenario).key]
            self._last_scenario = scenario
        return out

    @property
    def switch_s(self) -> float:
        moved = migration(
            self.job, self._last, self.model, source=self._active, scenario=self._last_scenario
        ).estimated_ms
        self._active = self._last
        self.migrations_ms.append(moved)
        return self.costs.reroute_s + moved / 1000.0
