"""The per-rank background persister: a snapshot on the training thread, then the agreement on
the step's folder (elastic/checkpoint/agreement.py), the collective shard save and rank 0's commit
in one background thread.

The folder layout and the commit protocol are `elastic.checkpoint.layout`'s; the DCP save is
`elastic.checkpoint.dcp_io`'s.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from torch.distributed.checkpoint.api import CheckpointException

from elastic.checkpoint.agreement import (BROKEN, COMMITTED, FENCED, LATE, UNREADABLE, Fenced,
                                          PersistAgreement)
from elastic.checkpoint.dcp_io import UploadBound, save_shards, snapshot, staging_for, written_files
from elastic.checkpoint.layout import COMMIT_MARKER, MANIFEST, Manifest, commit, step_dir
from elastic.checkpoint.retention import apply_retention
from elastic.checkpoint.retry import is_peer_failure
from elastic.checkpoint.uploader import UploadCut, UploadFenced
from elastic.protocol import PersistResult
from elastic.storage import Storage, StorageError

log = logging.getLogger(__name__)


class AsyncCheckpointer(PersistAgreement):
    """Per-rank background persister.

    `save()` takes an in-memory snapshot on the training thread (the only part
    that blocks a step) and hands it to one background thread. That thread, in
    three phases that never re-enter each other:

    1. agrees with every rank, over the checkpoint group, on what to do with the
       step's folder (rank 0 looks at storage; a committed folder is reported, not
       rewritten) and on whether everyone may still write (`may_write`);
    2. runs the collective DCP save on a dedicated process group, retrying storage
       errors in lockstep (DCP raises the same exception on every rank);
    3. on rank 0 alone, writes the manifest and commit marker with its own retries,
       then applies retention, whose errors are only logged.

    A new `save()` first waits for the previous persist, so at most one is in flight
    and every rank issues the same collectives in the same order.

    When the group fails, its persist can never commit, but an upload in progress cannot be
    interrupted either: the worker leaves it running and hands it to the next
    group's checkpointer as `after`, which waits for it before it writes anything.
    """

    def __init__(self, storage: Storage, root: str, rank: int, world_size: int, strategy: str,
                 process_group, retries: int, backoff_s: float, num_to_keep: int, *,
                 data_order: dict[str, int] | None = None,
                 may_write: Callable[[], bool | tuple[bool | None, str]] | None = None,
                 after: Sequence["AsyncCheckpointer"] = (), wait_timeout_s: float = 60.0,
                 staged: Any = None, rollback_window: int = 0, upload_bound: UploadBound | None = None,
                 persist_timeout_s: float | None = None):
        """`data_order`: what the run's sample order depends on (global_batch_size, seed,
        num_samples), stored in every manifest so a resume can refuse another order.
        `may_write`: asked before the shard save and again before the commit; False, (False,
        why) or an exception abandons the persist, reported with an error starting "fenced:".
        (None, why) means not now (this group's fence has not landed, or the fence cannot be
        read): asked again until it says yes or no, within the wait bound below, before the
        save (an unreadable fence as often as a failed write is retried); at the commit, a fence
        not landed is refused and an unreadable one retried as a storage error. A persist given
        up on an unreadable fence leaves its checkpoint owed (its error is a storage failure's,
        not "fenced:"). A `fencing.Fence` is also checked by
        the upload itself, before each object it writes.
        `after`: checkpointers of this process's earlier groups whose persist was abandoned while
        still uploading. Each persist first waits for them: a late upload of theirs must never
        land on a file this one wrote. If one still runs on any rank, every rank skips that
        persist ("skipped:").
        `wait_timeout_s`: the most a persist waits for both, in its background thread, before
        the ranks agree; keep it well under the checkpoint group's collective timeout.
        `staged`: staging buffers to copy the first snapshot into (`spare_buffers()` of this
        process's previous checkpointer, or None).
        `rollback_window`: retention's (see `apply_retention`): bad_step_limit - 1 under
        train.bad_step=rollback, else 0.
        `upload_bound`: a remote upload still running past it is cut short (`StorageTimeout`),
        retried and reported like any storage error.
        `persist_timeout_s` (checkpoint.persist_timeout_s): the most one persist may run, from
        its save() on. The worker gives a persist past it up (`expire`, `wait_within_bound`):
        its upload is cut short, it stops retrying, it never commits, and it reports an error
        starting "timed out:", a storage failure (the checkpoint stays owed). None: no bound."""
        self.storage, self.root = storage, root
        self.rank, self.world_size, self.strategy = rank, world_size, strategy
        self.pg, self.retries, self.backoff_s, self.num_to_keep = process_group, retries, backoff_s, num_to_keep
        self.data_order = dict(data_order or {})
        self._skip_steps: list[int] = []  # of the save in flight (see save)
        self.rollback_window = rollback_window
        self.may_write = may_write
        self.results: "queue.Queue[PersistResult]" = queue.Queue()
        self._thread: threading.Thread | None = None
        self._abort = threading.Event()  # the group failed: no persist of this checkpointer commits
        self._aborted_at = 0.0
        # The persist in flight stops (cut short, no more retries, never committed): set by
        # `abort` for the group, or by `give_up` for this persist alone. One per persist.
        self._stop = threading.Event()
        self._gave_up: str | None = None  # why the persist in flight was given up (`give_up`)
        self.upload_bound = upload_bound
        self.persist_timeout_s = persist_timeout_s
        self._started_at = 0.0  # monotonic, of the persist last started
        self._staged = staged  # the last snapshot: its buffers are reused once its persist is done
        self._prestage: threading.Thread | None = None
        self._prestaged = None
        # A copy of the state that already exists (memory_sync's in-memory copy of a step) may
        # serve as a checkpoint's snapshot: (step, snapshot, its owner), see `share`.
        self._shared: tuple[int, Any, Any] | None = None
        self._reading: Any = None  # the owner of the shared snapshot the persist last started reads
        self.shares_copies = False  # every checkpoint step has such a copy: no staging buffers made
        self._after = list(after)
        self._wait_timeout_s = wait_timeout_s
        self.step_in_flight: int | None = None  # the step of the persist last started
        self.writing = threading.Event()  # the persist last started writes its shards to storage
        self.cuttable = threading.Event()  # ... in an upload that abort() cuts short (see `upload`)

    def abort(self) -> None:
        """The group is being torn down: an in-flight persist stops retrying, its upload is cut
        short (async filesystems: see `upload`), and it is never committed."""
        if not self._abort.is_set():
            self._aborted_at = time.monotonic()
        self._abort.set()
        self._stop.set()

    def give_up(self, why: str) -> None:
        """Stop the persist in flight alone (the group goes on): its upload is cut short, it stops
        retrying, it never commits, and it reports "timed out: `why`". The next save() starts
        afresh once its thread has ended."""
        if self.in_flight() and not self._stop.is_set():
            self._gave_up = why
            log.warning("persist of step %s given up: %s", self.step_in_flight, why)
            self._stop.set()

    def overdue(self) -> bool:
        """The persist in flight has run past checkpoint.persist_timeout_s."""
        return (self.persist_timeout_s is not None and self.in_flight()
                and time.monotonic() - self._started_at > self.persist_timeout_s)

    def expire(self) -> bool:
        """Give the persist in flight up if it is overdue; True if it was (now or before)."""
        if self.overdue():
            self.give_up(f"it ran past checkpoint.persist_timeout_s={self.persist_timeout_s:g} s")
        return self._gave_up is not None and self.in_flight()

    def wait_within_bound(self, grace_s: float) -> float:
        """Wait for the persist in flight until checkpoint.persist_timeout_s after its start;
        give it up then, and wait at most `grace_s` more for it to end (a cut upload ends at its
        next poll). A persist that does not end even then (a synchronous filesystem's call, a
        collective until its timeout) is left running. Returns seconds waited."""
        if self.persist_timeout_s is None:
            return self.wait()
        t0 = time.monotonic()
        self.wait(max(0.0, self._started_at + self.persist_timeout_s - t0))
        if self.expire():
            self.wait(grace_s)
        return time.monotonic() - t0

    def aborted(self) -> bool:
        """`abort` was called: the group failed, and a persist in flight can never commit."""
        return self._abort.is_set()

    def wait(self, timeout_s: float | None = None) -> float:
        """Block until the in-flight persist (if any) is done, or at most `timeout_s`; returns
        seconds waited. A persist still running after the timeout stays `in_flight`."""
        t0 = time.monotonic()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._thread = None
        return time.monotonic() - t0

    def in_flight(self) -> bool:
        """A persist is still running (storage slow or down): the next save would block on it."""
        return self._thread is not None and self._thread.is_alive()

    def cut_pending(self) -> bool:
        """Aborted during an upload that is being cut short: the persist ends at the upload's next
        poll, as soon as its thread gets the CPU (on a loaded machine, not at once)."""
        return self._abort.is_set() and self.cuttable.is_set() and self.in_flight()

    def needs_staging(self) -> bool:
        """No staging buffers yet, and none being made: `prestage` would make them. Never while
        every checkpoint step's snapshot is an in-memory copy's (`shares_copies`)."""
        return self._staged is None and self._prestage is None and not self.shares_copies

    def share(self, step: int, snap: Any, owner: Any) -> None:
        """`snap`, a private copy of the state at `step` whose tensors are `owner`'s (an in-memory
        copy, elastic/runtime/memory_copies.py), is the snapshot of a checkpoint at that step:
        no second copy of the same bytes. The owner must not change them while `reads(owner)`."""
        self._shared = None if snap is None else (step, snap, owner)

    def reads(self, owner: Any) -> bool:
        """Whether the persist in flight reads the tensors of `owner` (shared with `share`)."""
        if self._reading is not None and not self.in_flight():
            self._reading = None  # done with: its owner's memory is no longer held here
        return owner is not None and self._reading is owner

    def prestage(self, state: dict) -> None:
        """Make the staging buffers of `state` (`staging_for`) in a background thread, ahead of
        the first checkpoint, which then copies into them instead of stopping its step while
        fresh memory is faulted in (pinned, on a GPU). Call it once the state has its final
        shapes (after the first optimizer step: AdamW makes its moments there)."""
        if not self.needs_staging():
            return

        def run() -> None:
            try:
                self._prestaged = staging_for(state)
            except Exception:  # noqa: BLE001 - best effort: the first snapshot allocates as before
                log.debug("prestaging failed", exc_info=True)

        self._prestage = threading.Thread(target=run, name="prestage", daemon=True)
        self._prestage.start()

    def spare_buffers(self) -> Any:
        """The staging buffers, for this process's next checkpointer, once this one is done with
        them (None while a persist may still read its snapshot)."""
        if self.in_flight() or (self._prestage is not None and self._prestage.is_alive()):
            return None
        return self._staged if self._staged is not None else self._prestaged

    def save(self, step: int, cursor: int, state: dict, metrics: dict[str, float],
             skip_steps: Iterable[int] = ()) -> float:
        """Snapshot now, persist in the background. Returns the seconds the caller was blocked.
        `skip_steps`: the steps whose batches a rollback skips, recorded in the manifest."""
        t0 = time.monotonic()
        self.wait()
        self._skip_steps = sorted(s for s in skip_steps if s <= step)  # one persist at a time: read by it
        if self._prestage is not None and self._staged is None:
            self._prestage.join()
            self._staged, self._prestaged = self._prestaged, None
        shared, self._shared = self._shared, None
        if shared is not None and shared[0] == step:
            # Its buffers stay the owner's: never staged into by a later snapshot.
            snap, self._reading = shared[1], shared[2]
        else:
            snap, self._reading = snapshot(state, self._staged), None
            self._staged = snap
        stall_s = time.monotonic() - t0
        self.step_in_flight = step
        self.writing = threading.Event()
        self.cuttable = threading.Event()
        self._stop, self._gave_up = threading.Event(), None
        if self._abort.is_set():
            self._stop.set()
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._persist, args=(step, cursor, snap, dict(metrics), stall_s),
                                        name=f"persist-{step}", daemon=True)
        self._thread.start()
        return stall_s

    def _persist(self, step: int, cursor: int, snap: dict, metrics: dict, stall_s: float = 0.0) -> None:
        folder = step_dir(self.root, step)
        writing, cuttable = self.writing, self.cuttable
        t0 = time.monotonic()

        def report(committed=False, attempts=0, error=None, reused=False, metrics_=None) -> None:
            self.results.put(PersistResult(step, folder, committed, time.monotonic() - t0, attempts, error,
                                           metrics_ or {}, reused, stall_s))

        # 1. Agree on the folder. Every rank must take the same path below, or one would enter
        # the collective save alone and wait there for peers that never come.
        try:
            verdict, detail, found = self._agree(folder, step)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - the group failed: nothing to retry
            return report(error=f"{type(e).__name__}: {e}")
        if self._gave_up is not None and verdict != COMMITTED:
            return report(error=self._timed_out(folder, detail or None))
        if verdict in (FENCED, LATE):
            return report(error=detail)
        if verdict == COMMITTED:
            # A redone step (recovery from storage): its folder was committed by the attempt that
            # was lost, with the state this attempt recomputed. Never rewritten in place.
            return report(committed=self.rank == 0, reused=True,
                          metrics_=found.metrics if found is not None else metrics)
        if verdict in (BROKEN, UNREADABLE):
            return report(error=detail or f"rank 0 could not prepare {folder}; nothing saved")

        # 2. Shards, collectively: retried in lockstep, because DCP raises on every rank.
        saved, err, attempt = None, None, 0
        for attempt in range(1, self.retries + 2):
            try:
                saved = save_shards(snap, folder, self.storage.options, self.pg, on_write=writing.set,
                                    cancel=self._stop, on_cuttable=cuttable.set, fence=self._fence(),
                                    upload_bound=self.upload_bound)
                err = None
                break
            except UploadCut:
                if self._gave_up is not None:
                    return report(attempts=attempt, error=self._timed_out(folder))
                return report(attempts=attempt, error=f"abandoned: the group failed during the upload, cut "
                                                      f"short {time.monotonic() - self._aborted_at:.2f} s after; "
                                                      f"never committed")
            # DCP's CheckpointException is a BaseException, not an Exception.
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - storage and peer errors: retry or report
                err = f"{type(e).__name__}: {e}"
                if self._stop.is_set() or is_peer_failure(e):
                    break  # the group is gone (or the persist given up): retrying is pointless
                if self._any_rank_fenced(isinstance(e, UploadFenced)):
                    return report(attempts=attempt, error=f"fenced: rank {self.rank}: {e}; {folder} not committed"
                                  if isinstance(e, UploadFenced) else
                                  f"fenced: another rank's upload found the run moved on; {folder} not committed")
                log.warning("persist of step %d failed (attempt %d): %s", step, attempt, err)
                if attempt > self.retries or self._stop.wait(self.backoff_s * 2 ** (attempt - 1)):
                    break
        if self._gave_up is not None:
            return report(attempts=attempt, error=self._timed_out(folder, err))
        if err is not None:
            return report(attempts=attempt, error=err)
        if self._abort.is_set():
            # The group failed during the save: what the shards' collective said may not hold (a
            # rank whose group is already destroyed skips it, as a single process would).
            return report(attempts=attempt, error="abandoned: the group failed during the save; never committed")
        if self.rank != 0:
            return report(attempts=attempt, metrics_=metrics)

        # 3. Commit: rank 0 alone, with its own retries; nothing collective from here on.
        try:
            self._commit_with_retries(folder, step, cursor, metrics, saved)
        except (StorageError, Fenced) as e:
            return report(attempts=attempt, error=self._timed_out(folder, str(e)) if self._gave_up else str(e))
        report(committed=True, attempts=attempt, metrics_=metrics)
        # Retention deletes only while this generation may write: a zombie's deletes could
        # remove what the run that moved on still restores from. Asked again before each object
        # it removes: a freeze between this check and a delete must not let the rest go.
        ok, why = self._allowed()
        if not ok:
            log.warning("retention after step %d skipped: %s", step, why)
            return
        try:
            apply_retention(self.storage, self.root, self.num_to_keep,
                            rollback_window=self.rollback_window, may_delete=self._allowed)
        except Exception as e:  # noqa: BLE001 - old folders stay until the next pass; the commit stands
            log.warning("retention after step %d failed (next checkpoint retries): %s", step, e)

    def _timed_out(self, folder: str, last_error: str | None = None) -> str:
        """The error of a persist given up (`give_up`): a storage failure, so the checkpoint is owed."""
        last = f" (last error: {last_error})" if last_error else ""
        return (f"timed out: {self._gave_up}; the persist of {folder} was given up{last}, its upload cut "
                f"short; never committed, saved again once storage answers")

    def _commit_with_retries(self, folder: str, step: int, cursor: int, metrics: dict, saved) -> None:
        """Manifest then marker, on rank 0, after every rank's shards are written (DCP said so).
        The manifest (with every file's digest, `saved.digests`) is built once, so a retry writes
        the same bytes."""
        wrote = written_files(saved.metadata)
        manifest = None
        for attempt in range(self.retries + 1):
            ok, why = self._allowed()
            if ok is False:
                raise Fenced(f"fenced: rank 0: {why}; {folder} not committed")
            try:
                if ok is None:  # the fence cannot be read: never commit on it; retried as storage is
                    raise StorageError(why)
                if manifest is None:
                    names = self.storage.sizes(folder)
                    if wrote is None:  # no index to go by: take what is there
                        files = {n: s for n, s in names.items() if n not in (MANIFEST, COMMIT_MARKER)}
                    else:
                        missing = sorted(wrote - names.keys())
                        if missing:
                            raise StorageError(f"{folder}: {missing} written by the save are not listed there")
                        files = {n: names[n] for n in wrote}
                    manifest = Manifest(step, cursor, self.world_size, self.strategy, files, time.time(), metrics,
                                        self.data_order, {n: d for n, d in saved.digests.items() if n in files},
                                        self._skip_steps,
                                        item_digests={n: d for n, d in saved.item_digests.items()
                                                      if n in files})
                commit(self.storage, folder, manifest)
                return
            except StorageError as e:
                if attempt == self.retries or self._stop.wait(self.backoff_s * 2 ** attempt):
                    raise StorageError(f"commit of {folder} failed after {attempt + 1} attempt(s): {e}") from e
                log.warning("commit of step %d failed (attempt %d): %s", step, attempt + 1, e)

    def drain(self) -> list[PersistResult]:
        """Results of finished persists, each once."""
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out
