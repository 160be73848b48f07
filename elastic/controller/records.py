"""The controller's run state, in typed records: what it knows across states and iterations.

Each record has one owner among the controller's modules (named in its docstring); the others
only read it. What lives within one state (a run loop's watch, a recovery's lost ranks) is in
that state's object (elastic/controller/states.py), not here.
"""
from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from elastic.data.order import GlobalOrder
from elastic.protocol import STEP_FIELDS
from elastic.storage import Storage, StorageError, join

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where training stands, from the polls (owner: reports.py)."""

    step: int = 0  # the step every rank has completed
    max_step_seen: int = 0  # the furthest step any rank reported (a resize's or a fault's lost steps)
    loss: float | None = None
    step_times: deque = field(default_factory=lambda: deque(maxlen=50))  # recent step times, for the hang bound
    last_progress_at: float = 0.0
    eval_seen: tuple | None = None  # (step, forwards) of the newest evaluation progress polled
    # rank -> its newest answer in this run (its RankStatus, whether a persist of its is in flight):
    # one dict update per poll, read only for the ranks a decision asks about
    reports: dict = field(default_factory=dict)


@dataclass
class Checkpoints:
    """What is committed, as the ranks report it and storage confirms (owner: reports.py; the
    restore, recovery and finish handlers refresh `last_committed` from storage)."""

    last_committed: str | None = None
    committed_steps: set = field(default_factory=set)  # steps whose checkpoint a rank reported committed


@dataclass
class RecoveryRecord:
    """A recovery in progress, until the recovered group completes a step (owner: recovery.py
    opens it, reports.py closes it with the `recovered` event)."""

    fault_t: float | None  # wall-clock time of the fault where known (injected); None: a fault from outside
    detected_t: float
    fault_step: int
    resumed_step: int = 0  # set once the group restored
    restored_t: float | None = None  # wall clock once the state was in place on every rank
    moved: dict = field(default_factory=dict)  # what the restore moved (restoring.moved_state)


@dataclass
class ResizeRecord:
    """A resize in progress, until the first step at the new size (owner: resize.py opens it,
    reports.py closes it with the `resize_completed` event)."""

    decided_t: float
    old_world_size: int
    new_world_size: int
    reason: str
    path: str | None = None  # "memory" | "storage" | "storage (after a failed re-shard in memory)"
    restore_s: float | None = None  # set once the group restored at the new size
    source: str | None = None
    resumed_step: int | None = None
    reached_step: int | None = None
    restored_t: float | None = None  # wall clock once the state was in place at the new size
    moved: dict = field(default_factory=dict)  # what the restore moved (restoring.moved_state)


STEP_TIMES_KEPT = 100_000  # step records kept for steps.json, over all ranks (the newest per rank)


@dataclass
class RunLog:
    """What the run leaves beside its checkpoints: the loss curve (metrics.json), the sample ledger
    (ledger.json), the steps that made no update, and each rank's latest step times (steps.json,
    the trace's compute and waiting) (owner: reports.py folds, restoring.py notes where each group
    starts, finish.py writes)."""

    loss_curve: dict = field(default_factory=dict)  # step -> (global mean loss, world size)
    # step -> {name: global mean} of the loss function's own metrics
    user_metrics: dict = field(default_factory=dict)
    # rank -> its newest (step, t_end, step_s, compute_s), at most STEP_TIMES_KEPT / world size each
    step_times: dict = field(default_factory=dict)
    # step -> (world size, {rank: sample ids}); a redone step replaces what the lost attempt wrote
    ledger: dict = field(default_factory=dict)
    num_samples: int = 0  # the dataset's length, as the ranks' ledger entries report it
    skipped: dict = field(default_factory=dict)  # step -> why it made no update (bad step, fp16 overflow, rollback)
    skip_steps: set = field(default_factory=set)  # steps whose batches a rollback skips (no update)
    # (step a group restored, its data world), in order: the group that trained each later step
    eras: list = field(default_factory=list)
    evaluations: dict = field(default_factory=dict)  # step -> EvalResult (controller/evaluations.py)

    def write_metrics(self, storage: Storage, run_dir: str, holds: Callable[[], tuple[bool, str]]) -> None:
        """metrics.json: the loss of every step, the world size it ran at and the loss function's
        own metrics, if it returns any (redone steps: the attempt that counted). Only while
        `holds()` says this controller still holds the run
        (`FenceWriter.holds`): one that lost it must not overwrite the new holder's."""
        held, why = holds()
        if not held:
            log.warning("metrics.json not written: this controller no longer holds the run (%s)", why)
            return
        body = {str(s): {"loss": x, "world_size": w, **self.user_metrics.get(s, {})}
                for s, (x, w) in sorted(self.loss_curve.items())}
        for s, ev in sorted(self.evaluations.items()):  # train.eval_dataset: {"eval": {name: value}}
            body.setdefault(str(s), {})["eval"] = ev.metrics
        try:
            storage.write_bytes(join(run_dir, "metrics.json"), json.dumps(body).encode())
        except Exception as e:  # noqa: BLE001 - metrics are best effort; the run's outcome is not
            log.warning("metrics.json not written: %s", e)

    def record_step(self, rank: int, step: int, t_end: float, step_s: float, compute_s: float, world: int) -> None:
        kept = self.step_times.get(rank)
        size = max(50, min(2000, STEP_TIMES_KEPT // max(1, world)))
        if kept is None or kept.maxlen != size:
            kept = self.step_times[rank] = deque(kept or (), maxlen=size)
        kept.append((step, round(t_end, 6), round(step_s, 6), round(compute_s, 6)))

    def write_steps(self, storage: Storage, run_dir: str, holds: Callable[[], tuple[bool, str]]) -> None:
        """steps.json: each rank's newest steps, `[step, end (wall clock), seconds, compute seconds]`
        (`elastic timeline --trace` draws them). A row is a rank number, like the timeline's.
        Best effort, and only while this controller still holds the run."""
        held, why = holds()
        if not held or not self.step_times:
            return
        body = {"fields": list(STEP_FIELDS),
                "ranks": {str(r): list(rows) for r, rows in sorted(self.step_times.items())}}
        try:
            storage.write_bytes(join(run_dir, "steps.json"), json.dumps(body).encode())
        except Exception as e:  # noqa: BLE001 - step times are best effort; the run's outcome is not
            log.warning("steps.json not written: %s", e)

    def write_ledger(self, storage: Storage, run_dir: str, holds: Callable[[], tuple[bool, str]],
                     seed: int, global_batch_size: int, upto: int) -> None:
        """ledger.json: for every step up to `upto` (the final state's), the world size it ran at
        and each rank's sample ids. Only while `holds()` says this controller still holds the run;
        StorageError otherwise."""
        held, why = holds()
        if not held:
            raise StorageError(f"ledger.json not written: this controller no longer holds the run ({why})")
        self._fill_unreported(upto)
        body = {}
        for s, (w, by_rank) in sorted(self.ledger.items()):
            derived = _derive_missing(s, w, by_rank, self.num_samples, seed, global_batch_size)
            body[str(s)] = {"world_size": w, "ranks": {str(r): ids for r, ids in sorted(by_rank.items())},
                            **({"derived": derived} if derived else {}),
                            **({"skipped": self.skipped[s]} if s in self.skipped else {})}
        storage.write_bytes(join(run_dir, "ledger.json"), json.dumps(body).encode())

    def _fill_unreported(self, upto: int) -> None:
        """Steps no rank's report reached: a step's share is reported by one rank per replica (with
        a pipeline, its first stage's first tp slice), so a node lost with every reporter of a
        replica takes their unpolled steps along. Each step up to `upto` that some group trained
        (after it restored, `eras`) is in the final state, which a restore took from a state that
        had trained it; its slices are the plan's (_derive_missing marks them all derived), at the
        data world of the last group to start before it."""
        for s in range(1, upto + 1):
            if s in self.ledger:
                continue
            world = next((w for start, w in reversed(self.eras) if start < s), None)
            if world is not None:
                self.ledger[s] = (world, {})


def _derive_missing(step: int, world: int, by_rank: dict, num_samples: int, seed: int,
                    global_batch_size: int) -> list[str]:
    """Completes `by_rank` in place with the replicas whose report of `step` is missing, and says
    which. A replica's report lives in its process until the next poll, so a rank lost right
    after a step takes its last steps' reports with it. Any report of the step is a survivor's
    that completed it, so every replica trained on its slice (its gradient is in the step's
    all-reduce), and that slice is a function of the step, the world size, the run's seed and
    the dataset's length (elastic.data.order): the plan every rank computed its own from."""
    missing = [r for r in range(world) if r not in by_rank]
    if not missing or not num_samples:
        return []
    order = GlobalOrder(num_samples, seed)
    for r in missing:
        by_rank[r] = order.rank_indices(step - 1, global_batch_size, world, r)  # keyed by steps done
    return [str(r) for r in missing]


@dataclass
class GrowDeferral:
    """A grow waiting for the checkpoint persist in flight to end (owner: resize.py)."""

    last_committed: str | None  # the newest commit when the grow was deferred


@dataclass
class Housekeeping:
    """Timers and once-only notes of the background care (owners: lifecycle.py, reports.py)."""

    grow_checked_at: float = 0.0
    spares_checked_at: float = 0.0
    excused: set = field(default_factory=set)  # silent ranks kept alive by their heartbeat, this silent spell
    beats: dict = field(default_factory=dict)  # rank -> Beat at the run loop's last look (run_finished)
    stale: set = field(default_factory=set)  # (rank, generation) of stale answers already logged
    lease_lapsed: bool = False  # a lease_lapsed event is out, its lease_renewed not yet
    lease_checked_at: float = float("-inf")  # the last renewal the loop asked for itself (stale lease)
