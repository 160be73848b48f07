"""Prometheus metrics of a run: the catalogue, the mapping from what the controller sees to
metric updates, and their export through `ray.util.metrics`.

The controller feeds this module in three places: every event it emits (the event log's echo
hook, so every metric an event carries is derived here and nowhere else), the progress it folds
in from each poll (step, loss and per-rank step times, which are not events), and each straggler
window (whose ratios are events only when some rank is slow). `RunMetrics` turns those into
`Update`s and is pure apart from a little bookkeeping (which failure a recovery belongs to, the
step the steps counter last saw): tests feed it events and read the updates. A backend applies
them (elastic/observability/export.py): `RayBackend` to `ray.util.metrics` Gauges, Counters and
Histograms, created in the controller actor, whose node's Ray metrics agent (the head's) exports
them for Prometheus.

Ray prefixes application metrics with `ray_` and counters end in `_total`: `elastic_step` is
scraped as `ray_elastic_step`, `elastic_recoveries` as `ray_elastic_recoveries_total`
(`Metric.prometheus_names`). Ray adds its own labels (`SessionName`, `NodeAddress`,
`WorkerId`, ...) beside ours: `run`, and `rank`, `cause`, `state`, `decision` or `outcome`
where a metric has them.

Ray's histograms are exported as bucket counts; their `_sum` is rebuilt from bucket midpoints, so
it is approximate. The exact times of the last failure, recovery and persist are gauges beside them
(`elastic_last_*_seconds`).

Metrics are best effort (export.py): no update may raise into the controller.
"""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass, fields
from typing import Any

from elastic.protocol import LostCause, MemorySample

PROMETHEUS_PREFIX = "ray_"  # what Ray's metrics agent puts before every application metric
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PROGRESS_EVERY_S = 1.0  # progress comes with every poll (0.2 s); Ray exports once a second at most


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    description: str
    tags: tuple[str, ...] = ("run",)
    boundaries: tuple[float, ...] = ()

    @property
    def prometheus_names(self) -> tuple[str, ...]:
        """The series names a Prometheus scrape of Ray's metrics agent shows for it."""
        base = PROMETHEUS_PREFIX + self.name
        if self.kind == "counter":
            return (base + "_total",)
        if self.kind == "histogram":
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


CATALOGUE = (
    Metric("elastic_num_steps", "gauge", "Optimizer steps the run is to train (run.num_steps)."),
    Metric("elastic_step", "gauge", "Last step every rank has completed."),
    Metric("elastic_steps", "counter",
           "Steps completed, steps redone after a restore from storage included; rate() is steps per "
           "second over time, checkpoint stalls and recoveries included."),
    Metric("elastic_steps_per_second", "gauge",
           "1 / the slowest rank's last step time: the rate training runs at between stalls."),
    Metric("elastic_step_seconds", "gauge", "Wall time of the rank's last step.", ("run", "rank")),
    Metric("elastic_compute_seconds", "gauge",
           "The rank's own compute in its last step (forward and backward, not the all-reduce wait; CPU "
           "time for fsdp, HSDP and tp on a CPU).",
           ("run", "rank")),
    Metric("elastic_loss", "gauge", "Global mean loss of the last step."),
    Metric("elastic_user_metric", "gauge",
           "A metric the loss function returns beside the loss (its global mean), by name, as of "
           "the last committed checkpoint.", ("run", "metric")),
    Metric("elastic_world_size", "gauge", "Ranks in the training group."),
    Metric("elastic_spares_ready", "gauge", "Warm spare workers ready to take a rank's place."),
    Metric("elastic_start_time_seconds", "gauge",
           "Unix time this controller started the run (took its lease): one series per controller "
           "process, for as long as it lives. The run-lost alert's heartbeat: a run's newest "
           "controller by this value."),
    Metric("elastic_runs_ended", "counter",
           "1 on the series of the run's outcome (finished, failed) once its controller ends it. "
           "Ray's metrics agent serves a counter for as long as its node lives, after the "
           "controller is gone (a gauge lapses ~20 s after its last set): what the run-failed and "
           "run-lost alerts read a run's end from.", ("run", "outcome")),
    Metric("elastic_controller_state", "gauge",
           "1 for the controller's current state (Starting, Forming, Restoring, Running, Recovering, "
           "Swapping, Growing, Dropping, Trading, Finished, Errored), 0 for the others.", ("run", "state")),
    Metric("elastic_failures", "counter",
           "Ranks found lost, by cause (process_died, node_died, unreachable, unresponsive, hang, error, "
           "user_error).", ("run", "cause")),
    Metric("elastic_recoveries", "counter",
           "Recoveries completed (the first step after the failure done), by the cause of the failure.",
           ("run", "cause")),
    Metric("elastic_decisions", "counter",
           "Controller decisions (Restart, Raise, Swap, Drop, Report, Grow, Regroup, Trade).", ("run", "decision")),
    Metric("elastic_detect_seconds", "histogram",
           "Fault to the controller settling who is lost; only faults with a known time (injected ones).",
           ("run", "cause"), SECONDS_BUCKETS),
    Metric("elastic_recover_seconds", "histogram",
           "Fault (or its detection, when the fault time is unknown) to the first step done after it.",
           ("run", "cause"), SECONDS_BUCKETS),
    Metric("elastic_last_detect_seconds", "gauge", "elastic_detect_seconds of the last failure, exactly."),
    Metric("elastic_last_recover_seconds", "gauge", "elastic_recover_seconds of the last recovery, exactly."),
    Metric("elastic_lost_steps", "counter", "Steps redone after recoveries (0 for a restore from memory)."),
    Metric("elastic_skipped_steps", "counter",
           "Steps that made no update (train.bad_step skip or rollback, an fp16 overflow)."),
    Metric("elastic_rollbacks", "counter", "Rollbacks after bad steps in a row (train.bad_step: rollback)."),
    Metric("elastic_checkpoint_step", "gauge", "Step of the last committed checkpoint."),
    Metric("elastic_checkpoints", "counter",
           "Checkpoint outcomes: committed, failed (one per rank that reported it), deferred (a persist "
           "still running).", ("run", "outcome")),
    Metric("elastic_checkpoint_persist_seconds", "histogram",
           "Background persist of a checkpoint to storage, from the save to the commit.", ("run",), SECONDS_BUCKETS),
    Metric("elastic_last_persist_seconds", "gauge", "elastic_checkpoint_persist_seconds of the last commit, exactly."),
    Metric("elastic_checkpoint_stall_seconds", "gauge",
           "Training time the rank's last checkpoint save blocked (snapshot, plus waiting for the previous "
           "persist).", ("run", "rank")),
    Metric("elastic_rank_rss_bytes", "gauge", "Resident host memory of the rank's worker process.", ("run", "rank")),
    Metric("elastic_rank_host_limit_bytes", "gauge",
           "Host memory the rank's process may use: its node's, or its cgroup's limit where lower (a pod's).",
           ("run", "rank")),
    Metric("elastic_rank_gpu_allocated_bytes", "gauge", "GPU memory held by the rank's tensors (CUDA only).",
           ("run", "rank")),
    Metric("elastic_rank_gpu_reserved_bytes", "gauge",
           "GPU memory the rank's caching allocator holds (CUDA only).", ("run", "rank")),
    Metric("elastic_rank_gpu_peak_allocated_bytes", "gauge",
           "Peak GPU memory held by the rank's tensors since its process started (CUDA only).", ("run", "rank")),
    Metric("elastic_rank_gpu_total_bytes", "gauge", "Memory of the rank's GPU (CUDA only).", ("run", "rank")),
    Metric("elastic_rank_gpu_fragmentation", "gauge",
           "Share of the rank's reserved GPU memory that is free but split into pieces a large allocation "
           "cannot use (CUDA only).", ("run", "rank")),
    Metric("elastic_straggler_ratio", "gauge",
           "The rank's median compute time in the last straggler window over the others' (stragglers.enabled).",
           ("run", "rank")),
)
METRICS: dict[str, Metric] = {m.name: m for m in CATALOGUE}
# Counters without labels, and so with one series from the start (0 until they move)
ZERO_AT_START = ("elastic_steps", "elastic_lost_steps", "elastic_skipped_steps", "elastic_rollbacks")
# Labelled counters, one series per value a run can give them, at 0 from the start: increase()
# over a series that first appears at 1 shows 0 (a combined cause, "node_died+unresponsive",
# is the one value not known in advance).
_CAUSES = tuple(c.value for c in LostCause) + ("user_error",)
ZERO_BY_LABEL = {
    "elastic_failures": ("cause", _CAUSES),
    "elastic_recoveries": ("cause", _CAUSES),
    "elastic_decisions": ("decision", ("Restart", "Raise", "Swap", "Drop", "Report", "Grow", "Regroup", "Trade")),
    "elastic_checkpoints": ("outcome", ("committed", "failed", "deferred")),
    "elastic_runs_ended": ("outcome", ("finished", "failed")),
}
# elastic.protocol.MemorySample's fields, each the metric elastic_rank_<field>
MEMORY_FIELDS = tuple(f.name for f in fields(MemorySample))
PER_RANK = tuple(m.name for m in CATALOGUE if "rank" in m.tags)


def _state_names() -> tuple[str, ...]:
    from elastic.controller.states import State
    return tuple(cls.__name__ for cls in typing.get_args(State))


@dataclass(frozen=True)
class Update:
    metric: str
    op: str  # "set" (gauge) | "inc" (counter) | "observe" (histogram)
    value: float
    tags: tuple[tuple[str, str], ...]  # every tag key of the metric, in its order

    @property
    def tag_dict(self) -> dict[str, str]:
        return dict(self.tags)


_OP = {"gauge": "set", "counter": "inc", "histogram": "observe"}


class RunMetrics:
    """Events and progress of one run -> metric updates. Holds only what a mapping needs across
    events: the cause of the failure a recovery is for, and the step the steps counter is at."""

    def __init__(self, run: str):
        self.run = run
        self._counted_step: int | None = None  # the steps counter counts from here (None: no restore yet)
        self._failure_cause: str | None = None  # of the failure the pending recovery is for
        self._user_error = False
        self._world_size: int | None = None

    def _u(self, name: str, value: float, **tags: Any) -> Update:
        m = METRICS[name]
        tags = {"run": self.run, **{k: str(v) for k, v in tags.items()}}
        assert set(tags) == set(m.tags), f"{name}: tags {sorted(tags)} != {m.tags}"
        return Update(name, _OP[m.kind], float(value), tuple((k, tags[k]) for k in m.tags))

    # ------------------------------------------------------------------ events
    def event(self, ev: dict) -> list[Update]:
        handler = getattr(self, f"_on_{ev.get('kind')}", None)
        return handler(ev) if handler else []

    def _on_run_started(self, ev: dict) -> list[Update]:
        self._counted_step = None
        out = [self._u("elastic_num_steps", ev["num_steps"])]
        if ev.get("t") is not None:  # the event's wall time (EventLog.emit)
            out.append(self._u("elastic_start_time_seconds", ev["t"]))
        out += [self._u("elastic_controller_state", 1 if s == "Starting" else 0, state=s) for s in _state_names()]
        # Series that have not moved yet exist with 0 from the start: rate(), increase() and an
        # alert see a 0, not nothing (a counter first seen at 1 has no increase to show).
        out += [self._u(name, 0) for name in ZERO_AT_START]
        out += [self._u(name, 0, **{tag: value}) for name, (tag, values) in ZERO_BY_LABEL.items() for value in values]
        out += [self._u("elastic_spares_ready", 0)]
        return out

    def _on_state(self, ev: dict) -> list[Update]:
        return [self._u("elastic_controller_state", 0, state=ev["old"]),
                self._u("elastic_controller_state", 1, state=ev["new"])]

    def _world(self, n: int) -> list[Update]:
        """World size; after a shrink, the per-rank series of the ranks that are gone are set to
        NaN: Ray has no way to drop a series, and its exporter leaves a NaN one out of the scrape."""
        old, self._world_size = self._world_size, n
        out = [self._u("elastic_world_size", n)]
        if old is not None and n < old:
            out += [self._u(name, math.nan, rank=r) for r in range(n, old) for name in PER_RANK]
        return out

    def _on_workers_started(self, ev: dict) -> list[Update]:
        return self._world(len(ev["ranks"]))

    def _on_group_formed(self, ev: dict) -> list[Update]:
        return self._world(ev["world_size"])

    def _on_restored(self, ev: dict) -> list[Update]:
        # The first restore is where this run starts (0, or the step of the checkpoint it resumes).
        # A later one is where training goes on from: steps redone after it count again, and steps
        # trained before it but not seen yet (survivors one step ahead) still count once.
        step = ev["step"]
        self._counted_step = step if self._counted_step is None else min(self._counted_step, step)
        return [self._u("elastic_step", ev["step"])] + self._world(ev["world_size"])

    def _on_resized(self, ev: dict) -> list[Update]:
        return self._world(ev["new_world_size"])

    def _on_spares_ready(self, ev: dict) -> list[Update]:
        return [self._u("elastic_spares_ready", ev["num_ready"])]

    _on_spares_not_ready = _on_spares_ready
    _on_spare_ready = _on_spares_ready

    def _on_user_error(self, ev: dict) -> list[Update]:
        self._user_error = True
        return []

    def _on_failure_detected(self, ev: dict) -> list[Update]:
        causes = [x.get("cause") or "unknown" for x in ev.get("lost") or ()]
        if not causes:
            causes = ["user_error" if self._user_error else "unknown"]
        cause = "+".join(sorted(set(causes)))
        if self._failure_cause is None:  # a failure during a recovery belongs to the first one
            self._failure_cause = cause
        out = [self._u("elastic_failures", 1, cause=c) for c in causes]
        if ev.get("detect_s") is not None:
            detect_s = max(0.0, ev["detect_s"])
            out += [self._u("elastic_detect_seconds", detect_s, cause=cause),
                    self._u("elastic_last_detect_seconds", detect_s)]
        return out

    def _on_decision(self, ev: dict) -> list[Update]:
        return [self._u("elastic_decisions", 1, decision=ev["decision"])]

    def _on_recovered(self, ev: dict) -> list[Update]:
        cause, self._failure_cause = self._failure_cause or "unknown", None
        recover_s = max(0.0, ev["recover_s"])
        out = [self._u("elastic_recoveries", 1, cause=cause),
               self._u("elastic_recover_seconds", recover_s, cause=cause),
               self._u("elastic_last_recover_seconds", recover_s)]
        if ev.get("lost_steps"):
            out.append(self._u("elastic_lost_steps", ev["lost_steps"]))
        return out + self._world(ev["world_size"])

    def _on_step_skipped(self, ev: dict) -> list[Update]:
        return [self._u("elastic_skipped_steps", 1)]

    def _on_rolled_back(self, ev: dict) -> list[Update]:
        return [self._u("elastic_rollbacks", 1)]

    def _on_checkpoint_committed(self, ev: dict) -> list[Update]:
        out = [self._u("elastic_checkpoint_step", ev["step"]), self._u("elastic_checkpoints", 1, outcome="committed")]
        user = sorted((ev.get("metrics") or {}).items())  # the loss function's own
        out += [self._u("elastic_user_metric", v, metric=k) for k, v in user
                if v is not None and math.isfinite(v)]
        if ev.get("attempts"):  # 0: a redone step's folder, committed before and not written again
            out += [self._u("elastic_checkpoint_persist_seconds", ev["persist_s"]),
                    self._u("elastic_last_persist_seconds", ev["persist_s"])]
        return out

    def _on_checkpoint_failed(self, ev: dict) -> list[Update]:
        return [self._u("elastic_checkpoints", 1, outcome="failed")]

    def _on_checkpoint_deferred(self, ev: dict) -> list[Update]:
        return [self._u("elastic_checkpoints", 1, outcome="deferred")]

    def _on_slow_window(self, ev: dict) -> list[Update]:
        return self.window(ev["ratios"])

    def _on_run_finished(self, ev: dict, outcome: str = "finished") -> list[Update]:
        out = [self._u("elastic_step", ev["step"])] + self.steps(ev["step"])
        if ev.get("loss") is not None:
            out.append(self._u("elastic_loss", ev["loss"]))
        return out + [self._u("elastic_runs_ended", 1, outcome=outcome)]

    def _on_run_failed(self, ev: dict) -> list[Update]:
        return self._on_run_finished(ev, outcome="failed")

    def _on_final_state(self, ev: dict) -> list[Update]:
        return [self._u("elastic_step", ev["step"])] + self.steps(ev["step"])

    # ------------------------------------------------------------------ not events
    def steps(self, step: int) -> list[Update]:
        """The steps counter only: cheap enough for every poll, so no step goes uncounted."""
        base = self._counted_step or 0
        if step <= base:
            return []
        self._counted_step = step
        return [self._u("elastic_steps", step - base)]

    def progress(self, step: int, loss: float | None, answers: dict, spares_ready: int | None = None) -> list[Update]:
        """The controller's step and loss, each answering rank's last step, compute and
        checkpoint-stall times and memory (a poll's answers: `elastic.protocol.PollReport`s), and
        the warm spares ready now (a spare that took a rank's place is no longer one)."""
        out = [self._u("elastic_step", step)] + self.steps(step)
        if spares_ready is not None:
            out.append(self._u("elastic_spares_ready", spares_ready))
        if loss is not None and math.isfinite(loss):
            out.append(self._u("elastic_loss", loss))
        for name, key in (("elastic_step_seconds", "step_s"), ("elastic_compute_seconds", "compute_s"),
                          ("elastic_checkpoint_stall_seconds", "ckpt_stall_s")):
            out += [self._u(name, getattr(a, key), rank=r) for r, a in sorted(answers.items())
                    if getattr(a, key) is not None]
        step_s = [a.step_s for a in answers.values() if a.step_s]
        if step_s:
            out.append(self._u("elastic_steps_per_second", 1.0 / max(step_s)))
        out += [self._u(f"elastic_rank_{name}", value, rank=r) for r, a in sorted(answers.items()) if a.memory
                for name in MEMORY_FIELDS if (value := getattr(a.memory, name)) is not None]
        return out

    def window(self, ratios: dict) -> list[Update]:
        """A straggler window's ratios (rank -> compute / the others' median), slow or not."""
        ordered = sorted(ratios.items(), key=lambda kv: int(kv[0]))  # event ranks are str keys
        return [self._u("elastic_straggler_ratio", x, rank=r) for r, x in ordered]
