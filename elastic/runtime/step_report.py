"""What a rank's steps report, and the verdict on each: the bad-step policy (train.bad_step) and
the records the next poll takes (compute times, losses, the sample ledger, skipped steps).

A step's statistics may be read a step late (elastic/runtime/step.py): the step is then
`Unsettled` until `settle` reads its host copy, judges it and reports it. Every rank reads the
same summed statistics at the same step, so every rank takes the same verdict at the same step.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from elastic.protocol import LedgerEntry, StepRecord
from elastic.runtime.compute_clock import ComputeClock
from elastic.runtime.step_stats import StepStats
from elastic.runtime.user_metrics import UserMetrics

if TYPE_CHECKING:
    from elastic.runtime.worker import Worker


class BadStep(RuntimeError):
    """A step's loss or gradient was not finite and train.bad_step says stop (the user's to fix).
    `step`: the bad step (it made no update; where its statistics were read a step late, the rank's
    counter has passed it, and the step after made no update either)."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


class RollBack(Exception):
    """train.bad_step=rollback: bad_step_limit bad steps in a row; the controller restores."""

    def __init__(self, bad_steps: list[int]):
        super().__init__(f"bad steps {bad_steps}")
        self.bad_steps = bad_steps


@dataclass
class Unsettled:
    """A step whose update is queued and whose statistics the host has not read yet."""

    step: int
    host: torch.Tensor  # the statistics' copy on the host (pinned on a GPU)
    event: object  # torch.cuda.Event: the copy has landed (None on a CPU)
    clock: ComputeClock
    t_start: float  # perf_counter at the step's start
    ended: tuple[float, float]  # (wall clock, seconds since t_start) once its work was queued
    skipped: bool  # a step of skip_steps: trained without an update, known before it ran
    norm_copies: int  # copies of each gradient element summed in GRAD_SUMSQ
    ledger: LedgerEntry | None


class StepReports:
    """The reporting half of `StepRunner` (which sets `w`, the worker, and `_lock`, the worker's
    lock that poll() drains these under)."""

    w: Worker
    _lock: threading.Lock
    user: UserMetrics

    def _init_reports(self) -> None:
        self.skip_steps: set[int] = set()  # steps (1-based) a rollback trains without an update
        self._bad_in_a_row: list[int] = []  # consecutive bad steps so far (since the last restore)
        # Reported by the next poll: (step, why) of steps that made no update; per step, the
        # rank's own compute seconds and the global mean loss; the sample ledger, if enabled.
        self.skipped: list[tuple[int, str]] = []
        self.compute_log: list[StepRecord] = []
        self.ledger: list[LedgerEntry] = []
        self.held_report = None  # memory_sync: the last step's report, until its copies are in
        self._unsettled: Unsettled | None = None  # the last step, its statistics not read yet
        self._last = StepStats.none()  # the newest statistics read
        self.last_metrics: dict[str, float] | None = None  # the user's, of the last step reported

    def take(self) -> tuple[tuple[StepRecord, ...], tuple[LedgerEntry, ...],
                            tuple[tuple[int, str], ...]]:
        """(compute log, ledger, skipped steps) since the last take, emptied. The caller holds
        the lock."""
        out = tuple(self.compute_log), tuple(self.ledger), tuple(self.skipped)
        self.compute_log, self.ledger, self.skipped = [], [], []
        return out

    def start_run(self, skip_steps) -> None:
        """A run() begins: its skip steps; nothing held or unread from a run that failed is kept."""
        self.held_report = None  # a report held when the last run failed is never made
        self._unsettled = None
        self._last = StepStats.none()
        self.skip_steps = set(skip_steps)

    @property
    def unsettled(self) -> bool:
        """Whether the last step's statistics are still to be read (`settle`)."""
        return self._unsettled is not None

    def settle(self, may_roll_back: bool = True) -> StepStats:
        """The last step's own statistics, read now (they were copied to the host without
        waiting), judged and reported; the newest read if there is none left to read."""
        rec, self._unsettled = self._unsettled, None
        if rec is None:
            return self._last
        if rec.event is not None:
            rec.event.synchronize()  # landed already unless the device is a whole step behind
        agreed = StepStats.read(rec.host)
        self._judge(rec.step, agreed, rec.skipped, may_roll_back)
        self._report(rec, agreed)
        return agreed

    def _judge(self, step: int, stats: StepStats, skipped: bool,
               may_roll_back: bool = True) -> bool:
        """Whether step `step` updated, decided the same way on every rank from the all-reduced
        stats (the device took the same decision where it masked the update): not after a
        rollback, nor after an fp16 overflow (the loss scale backs off), nor for a non-finite
        loss or gradient (train.bad_step: skipped, the run stopped, or rolled back)."""
        tr = self.w.job.train
        bad_loss, bad_grads = stats.bad_loss, stats.bad_grads
        if skipped:
            self._skip(step, "rolled back: this batch is skipped")
            return False
        if self.w.amp and bad_grads and not bad_loss:
            self._skip(step, "fp16 overflow: loss scale halved")
            return False
        if bad_loss or bad_grads:
            what = "loss" if bad_loss else "gradient norm"
            if tr.bad_step == "raise":
                raise BadStep(step, f"step {step}: non-finite {what} on some rank "
                                    "(train.bad_step=raise)")
            self._bad_in_a_row.append(step)
            self._skip(step, f"non-finite {what} (train.bad_step={tr.bad_step})")
            if len(self._bad_in_a_row) >= tr.bad_step_limit:
                if tr.bad_step == "skip":
                    run, limit = self._bad_in_a_row, tr.bad_step_limit
                    raise BadStep(step, f"steps {run}: {len(run)} bad steps in a row "
                                        f"(train.bad_step_limit={limit}); last: non-finite {what}")
                if may_roll_back:
                    raise RollBack(list(self._bad_in_a_row))
            return False
        self._bad_in_a_row = []
        return True

    def _report(self, rec: Unsettled, agreed: StepStats) -> None:
        """The step, done: what the next poll tells the controller."""
        w = self.w
        tr = w.job.train
        compute_s = rec.clock.seconds()  # on a GPU its events have passed: the copy came after
        checked = tr.clip_grad_norm is not None or w.amp
        w.set_progress(grad_norm=agreed.grad_norm(rec.norm_copies) if checked else None)
        loss = agreed.loss_sum / w.strategy.loss_ranks
        # The user's metrics, averaged as the loss is (elastic/runtime/user_metrics.py).
        metrics = ({n: x / w.strategy.loss_ranks for n, x in zip(self.user.names, agreed.user)}
                   if agreed.user else None)

        def report(at: tuple[float, float] | None = None) -> None:
            """Its time counts the wait for the copies where they held the report (`at` None)."""
            now, step_s = at or (time.time(), time.perf_counter() - rec.t_start)
            with self._lock:
                self.compute_log.append(StepRecord(rec.step, compute_s, loss, now, step_s, metrics))
                if rec.ledger is not None:
                    self.ledger.append(rec.ledger)
            self.last_metrics = metrics  # a checkpoint of this step keeps them beside its loss
            w.set_progress(step=rec.step, loss=loss, step_end=now, step_s=step_s,
                           compute_s=compute_s,
                           first_step_end=w._progress.get("first_step_end") or now)

        if w.copies.holds_report(rec.step):  # memory_sync: reported once every rank's copy is in
            self.held_report = report
        else:
            report(rec.ended)
        self._last = agreed

    def report_held(self) -> None:
        """Report the step whose report waited for its in-memory copies (memory_sync)."""
        report, self.held_report = self.held_report, None
        if report is not None:
            report()

    def _skip(self, step: int, why: str) -> None:
        with self._lock:
            self.skipped.append((step, why))

    def forget_bad_run(self) -> None:
        """After a restore every rank of the new group counts consecutive bad steps from zero:
        survivors and a replacement (which never saw the old count) then agree on when the limit
        is reached, so they roll back, or stop, together."""
        self._bad_in_a_row = []
