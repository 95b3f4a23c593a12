"""`recycle simulate`: an event-driven run of every strategy over one failure/rejoin trace.

Between events a strategy trains at the steady rate of its model for the current failure set
(D*M micro-batches per iteration). Every strategy checkpoints every `interval_s` seconds of training
(Young/Daly from the MTBF unless given), each checkpoint stalling `Costs.checkpoint_s`; the same
interval for all, so the comparison is about recovery, not checkpoint policy. At an event:

- a strategy that absorbs it (its model is not fatal) stalls for the in-flight iteration plus its
  switch cost (re-route, fail-over or reconfiguration);
- checkpoint-restart, and any strategy whose model is fatal (e.g. recycle when a stage has no alive
  worker), rolls back: the work since the last checkpoint is lost, the job stalls for the restart
  cost and continues in checkpoint-restart's configuration (spares, or the fully alive pipelines;
  nothing when none is). That is a fallback, counted and listed;
- a rejoin that changes a restarted job's configuration costs a checkpoint plus a restart (no work
  lost); returning from a fallback to the strategy's own mode likewise.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from planner.contract import FailureScenario, JobSpec
from whatif.strategies import CheckpointRestart, Costs, Strategy
from whatif.trace import FAIL, Event

log = logging.getLogger(__name__)


def samples_per_microbatch(job: JobSpec) -> int:
    """Samples (sequences) in one micro-batch: the spec's model.micro_batch when given, else 1."""
    model = getattr(job, "model", None)
    mb = model.get("micro_batch") if isinstance(model, dict) else None
    return int(mb) if isinstance(mb, int) and mb > 0 else 1


@dataclass
class RunFigures:
    """What one strategy achieved over the trace (times in seconds, samples in sequences)."""

    strategy: str
    samples: float = 0.0
    duration_s: float = 0.0
    gpu_hours: float = 0.0
    effective_throughput: float = 0.0  # samples per second of wall time
    retained_vs_1f1b: float = 0.0  # effective throughput / failure-free 1F1B throughput
    retained_vs_own: float = 0.0  # effective throughput / this strategy's own failure-free throughput
    recovery_s: float = 0.0  # stalls for switches and restarts
    lost_work_s: float = 0.0  # training rolled back to a checkpoint
    checkpoint_s: float = 0.0
    stalled_s: float = 0.0  # no configuration could run (a stage with no alive worker, no spares)
    restarts: int = 0
    checkpoint_fallbacks: int = 0  # failures that forced a roll-back to the last checkpoint
    fallback_events: list[dict[str, Any]] = field(default_factory=list)
    segments: list[tuple[float, float, float]] = field(default_factory=list)  # (t0, t1, samples/s)

    def to_dict(self, with_segments: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not with_segments:
            out.pop("segments")
        return out


class _Run:
    """One strategy's state while the trace plays."""

    def __init__(
        self, strategy: Strategy, fallback: CheckpointRestart, job: JobSpec, costs: Costs, interval_s: float
    ):
        self.s, self.fallback, self.costs, self.interval_s = strategy, fallback, costs, interval_s
        self.mb_per_iteration = job.num_pipelines * job.num_microbatches
        self.fig = RunFigures(strategy.name)
        self.failed: set[tuple[int, int]] = set()
        self.t = self.resume_at = 0.0
        self._stalls: list[tuple[float, float, str]] = []  # (start, end, the figure it counts in)
        self.pending = self.work_since_ckpt = 0.0  # micro-batches / seconds since the last checkpoint
        self.done = 0.0
        self.in_fallback = False
        self.iteration_ms = self._config_ms()

    def _scenario(self) -> FailureScenario:
        return FailureScenario(failed=sorted(self.failed))

    def _config_ms(self) -> float | None:
        sc = self._scenario()
        if self.s.restarts or self.in_fallback:
            return self.fallback.outcome(sc).iteration_time_ms
        return self.s.outcome(sc).iteration_time_ms

    @property
    def rate(self) -> float:
        return self.mb_per_iteration / (self.iteration_ms / 1000.0) if self.iteration_ms else 0.0

    def _stall(self, seconds: float, figure: str, anew: bool = False) -> None:
        """Nothing trains for `seconds` after what already stalls (a checkpoint write, a switch), counted
        in `self.fig.<figure>`; `anew`: a restart at a failure, which begins again now even when another
        one is under way (only the time it adds counts: restarts queued one after another counted more
        recovery than the run was long)."""
        start = max(self.t, self.resume_at)
        end = max(self.resume_at, self.t + seconds) if anew else start + seconds
        if end > start:
            setattr(self.fig, figure, getattr(self.fig, figure) + end - start)
            self.fig.segments.append((start, end, 0.0))
            self._stalls.append((start, end, figure))
        self.resume_at = end

    def advance(self, t_to: float) -> None:
        """Train (and checkpoint) from self.t to t_to at the current rate."""
        while self.t < t_to - 1e-9:
            if self.t < self.resume_at:
                self.t = min(self.resume_at, t_to)
                continue
            rate = self.rate
            if rate == 0.0:
                self.fig.stalled_s += t_to - self.t
                self.fig.segments.append((self.t, t_to, 0.0))
                self.t = t_to
                continue
            step = min(t_to - self.t, self.interval_s - self.work_since_ckpt)
            self.pending += rate * step
            self.work_since_ckpt += step
            self.fig.segments.append((self.t, self.t + step, rate))
            self.t += step
            if self.work_since_ckpt >= self.interval_s - 1e-9:
                self._checkpoint()

    def _checkpoint(self) -> None:
        self.done += self.pending
        self.pending = self.work_since_ckpt = 0.0
        self._stall(self.costs.checkpoint_s, "checkpoint_s")

    def _roll_back(self, event: Event, forced: bool) -> None:
        self.fig.lost_work_s += self.work_since_ckpt
        self.pending = self.work_since_ckpt = 0.0
        self.fig.restarts += 1
        if forced:
            self.fig.checkpoint_fallbacks += 1
            self.fig.fallback_events.append(
                {"time_s": event.time_s, "failed": [list(w) for w in sorted(self.failed)]}
            )
        self._stall(self.costs.restart_s, "recovery_s", anew=True)
        if self.costs.spares:
            self.failed.clear()
            self.in_fallback = False

    def _planned_restart(self) -> None:
        self.fig.restarts += 1
        self._checkpoint()
        self._stall(self.costs.restart_s, "recovery_s")

    def _switch(self) -> None:
        lost = (self.iteration_ms or 0.0) / 1000.0 + self.s.switch_s
        self._stall(lost, "recovery_s")

    def on_event(self, event: Event) -> None:
        """Apply one trace event at event.time_s (self.t has been advanced to it)."""
        before = self.iteration_ms
        if event.kind == FAIL:
            self.failed.add(event.worker)
            if self.s.restarts:
                self._roll_back(event, forced=True)
            elif self.in_fallback or self.s.outcome(self._scenario()).fatal:
                self.in_fallback = True
                self._roll_back(event, forced=True)
            else:
                self._switch()
        else:
            if event.worker not in self.failed:  # replaced by a spare at a restart
                return
            self.failed.discard(event.worker)
            own_ok = not self.s.restarts and not self.s.outcome(self._scenario()).fatal
            if self.in_fallback and own_ok:
                self.in_fallback = False
                self._planned_restart()
            elif self.s.restarts or self.in_fallback:
                if self._config_ms() != before:
                    self._planned_restart()
            else:
                self._switch()
        self.iteration_ms = self._config_ms()

    def finish(self, duration_s: float, job: JobSpec, gpus_per_worker: int, base_rate: float) -> RunFigures:
        self.advance(duration_s)
        fig = self.fig
        for start, end, figure in self._stalls:  # a stall running past the end counts up to the end only
            if end > duration_s:
                setattr(fig, figure, getattr(fig, figure) - (end - max(start, duration_s)))
        fig.segments = [(a, min(b, duration_s), r) for a, b, r in fig.segments if a < duration_s]
        per_mb = samples_per_microbatch(job)
        fig.samples = (self.done + self.pending) * per_mb
        fig.duration_s = duration_s
        fig.gpu_hours = job.num_pipelines * job.num_stages * gpus_per_worker * duration_s / 3600.0
        fig.effective_throughput = fig.samples / duration_s
        fig.retained_vs_1f1b = fig.effective_throughput / (base_rate * per_mb) if base_rate else 0.0
        own_ms = self.s.outcome(FailureScenario()).iteration_time_ms
        if own_ms:
            own_rate = self.mb_per_iteration / (own_ms / 1000.0) * per_mb
            fig.retained_vs_own = fig.effective_throughput / own_rate
        return fig


def simulate(
    job: JobSpec,
    strategies: dict[str, Strategy],
    fallback: CheckpointRestart,
    events: list[Event],
    duration_s: float,
    costs: Costs,
    interval_s: float,
    baseline_ms: float,
    gpus_per_worker: int = 1,
    progress: bool = False,
) -> dict[str, RunFigures]:
    """Play `events` (sorted) for `duration_s` seconds through every strategy. With `progress`, a run
    that takes more than a second shows how far it got on stderr (each strategy's model is evaluated
    on the failure sets as the trace reaches them, which is where the time goes)."""
    from whatif.precompute import ProgressBar

    base_rate = job.num_pipelines * job.num_microbatches / (baseline_ms / 1000.0)
    played = [ev for ev in events if ev.time_s < duration_s]
    bar = ProgressBar(len(played) * len(strategies), "simulating", enabled=progress, after_s=1.0)
    out = {}
    for name, strat in strategies.items():
        run = _Run(strat, fallback, job, costs, interval_s)
        for i, ev in enumerate(played):
            run.advance(ev.time_s)
            run.on_event(ev)
            bar.advance(note=f"{name}: event {i + 1}/{len(played)}")
        out[name] = run.finish(duration_s, job, gpus_per_worker, base_rate)
        log.info("%s: %.3g samples, %d restarts", name, out[name].samples, out[name].restarts)
    return out
