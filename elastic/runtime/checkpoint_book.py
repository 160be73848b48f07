"""One rank's checkpoint bookkeeping: the persist results it has yet to report, the checkpoint it
owes after a persist failed on storage, the persists of failed groups it left running, and the
checkpoint steps it saved again or skipped.

Each list is reported once, by the next `poll()`, and emptied (`take`). The worker's lock guards
it all: poll() answers on another thread than run() and leave().
"""
from __future__ import annotations

import threading
import time

from elastic.checkpoint.layout import step_dir
from elastic.checkpoint.persister import AsyncCheckpointer
from elastic.checkpoint.retry import owes_retry, retry_wait_s
from elastic.protocol import PersistResult


class CheckpointBook:
    def __init__(self, lock: threading.Lock, backoff_s: float):
        self._lock = lock
        self._backoff_s = backoff_s  # checkpoint.persist_retry_backoff_s
        self.persists: list[PersistResult] = []
        # Checkpointers of failed groups whose upload was still running when this rank left them:
        # reported on until done, and waited for by the next persist before it writes.
        self.abandoned: list[AsyncCheckpointer] = []
        self.abandoned_steps: list[int] = []  # their steps, until the next poll
        self.deferred: list[int] = []  # checkpoint steps skipped because a persist was in flight
        self.retried: list[int] = []  # steps saved again for a failed checkpoint, until the next poll
        # A persist of this rank failed on storage: a checkpoint is owed from `owe_at` (monotonic)
        # on, saved again at the first step boundary after it, however far the next checkpoint
        # step is; each failed retry doubles the wait (see retry_wait_s).
        self.owe_at: float | None = None
        self.owe_fails = 0

    def owes_now(self) -> bool:
        """This rank owes a checkpoint and its wait is over (the step's `owe` flag)."""
        return self.owe_at is not None and time.monotonic() >= self.owe_at

    def note_retried(self, step: int) -> None:
        with self._lock:
            self.retried.append(step)

    def note_deferred(self, step: int) -> None:
        with self._lock:
            self.deferred.append(step)

    def note_not_saved(self, step: int, root: str, error: str) -> None:
        """The checkpoint of `step` could not start (the previous persist still runs past its
        bound): reported as a failed persist, and owed like one that failed on storage."""
        with self._lock:
            self.persists.append(PersistResult(step, step_dir(root, step), False, 0.0, 0, error))
            self._note_persist(error)

    def abandon(self, ck: AsyncCheckpointer) -> None:
        """`ck`, of a group this rank leaves, still persists: left to end on its own."""
        with self._lock:
            self.abandoned.append(ck)
            self.abandoned_steps.append(ck.step_in_flight)

    def still_abandoned(self) -> tuple[AsyncCheckpointer, ...]:
        with self._lock:
            return tuple(self.abandoned)

    def collect(self, current: AsyncCheckpointer | None) -> None:
        """Take the results of every persist that ended, this group's (`current`) and abandoned
        ones; an abandoned one that ended is forgotten."""
        with self._lock:  # poll() runs beside run() and leave()
            running = [ck for ck in self.abandoned if ck.in_flight()]  # before draining: no result missed
            for ck in (*self.abandoned, current):
                if ck is not None:
                    results = ck.drain()
                    self.persists.extend(results)
                    if ck is current:
                        for r in results:
                            self._note_persist(r.error)
            self.abandoned = running

    def _note_persist(self, error: str | None) -> None:
        """A persist of this group ended: a storage failure leaves a checkpoint owed, after a wait
        that doubles with each failed retry; a success settles it."""
        if error is None:
            self.owe_at, self.owe_fails = None, 0
        elif owes_retry(error):
            self.owe_at = time.monotonic() + retry_wait_s(self._backoff_s, self.owe_fails)
            self.owe_fails += 1

    def take(self) -> tuple[tuple[PersistResult, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(persists, deferred, retried, abandoned steps) since the last take, emptied. The caller
        holds the lock (poll() reads the rank's progress in the same instant)."""
        out = tuple(self.persists), tuple(self.deferred), tuple(self.retried), tuple(self.abandoned_steps)
        self.persists, self.deferred, self.retried, self.abandoned_steps = [], [], [], []
        return out
