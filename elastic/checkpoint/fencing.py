"""Fencing: a worker from an older group generation never writes into the run's checkpoints.

A machine that stops and comes back (a thawed freeze, a healed partition)
resumes exactly where it was: in the middle of a persist, say, about to write
a commit marker for a group that no longer exists. The controller bumps the
group generation at every formation and writes it beside the checkpoints
(`<run>/checkpoints/GENERATION`) before the new group forms (a resubmitted run
numbers on from the fence an earlier submission left); a worker checks
it before it writes shards and again right before the commit marker, and
gives up if the run has moved past its generation.

Storage can be out when a group forms (an outage and a lost machine together).
A recovery from the survivors' memory needs no storage, so it does not wait:
the fence is written in the background, retried until it lands, and until it
does the new generation writes no checkpoint either (a worker waits for the
fence to show its own generation), so an older one can never write after a
newer one did.

Object stores have no compare-and-swap, so this narrows the window to the
time between the check and the write (milliseconds) rather than closing it;
the generation check on every report the controller reads, and the process
being killed once its node answers again, cover the rest.
"""
from __future__ import annotations

import threading

from elastic.storage import Storage, StorageError, join

FENCE = "GENERATION"


def write_fence(storage: Storage, checkpoints_root: str, generation: int) -> None:
    storage.write_bytes(join(checkpoints_root, FENCE), str(generation).encode())


def current_generation(storage: Storage, checkpoints_root: str) -> int | None:
    """The newest generation the controller announced; None if none was (or it can't be read)."""
    try:
        return int(storage.read_bytes(join(checkpoints_root, FENCE)).decode())
    except (StorageError, ValueError):
        return None


def may_write(storage: Storage, checkpoints_root: str, generation: int) -> tuple[bool | None, str]:
    """(allowed, why not). False when storage says the run has moved to a newer generation than
    `generation`; None (not yet: ask again) while the fence still shows an older one, because the
    controller's write of this generation's fence has not landed (storage was out when the group
    formed). An unreadable fence does not stop a writer (storage trouble is retried elsewhere)."""
    newest = current_generation(storage, checkpoints_root)
    if newest is None or newest == generation:
        return True, ""
    if newest > generation:
        return False, f"the run has moved on to generation {newest} (this worker's: {generation})"
    return None, (f"the fence still shows generation {newest}: the controller's write of generation "
                  f"{generation} has not landed")


class FenceWriter:
    """Writes the newest generation announced, in order, on one background thread, retrying a
    failed write until it lands or a newer generation replaces it. `announce` waits at most
    `wait_s` for the write and says whether it landed; a storage that hangs holds up no more."""

    def __init__(self, storage: Storage, checkpoints_root: str, backoff_s: float = 1.0):
        self.storage, self.root, self.backoff_s = storage, checkpoints_root, backoff_s
        self.last_error: BaseException | None = None  # of the last failed write, if any
        self._cv = threading.Condition()
        self._wanted = 0  # the newest generation announced
        self._written = 0  # the newest generation known to be in storage
        self._thread: threading.Thread | None = None

    def announce(self, generation: int, wait_s: float) -> bool:
        with self._cv:
            self._wanted = max(self._wanted, generation)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fence-writer", daemon=True)
                self._thread.start()
            self._cv.notify_all()
            return self._cv.wait_for(lambda: self._written >= generation, timeout=wait_s)

    def written(self) -> int:
        with self._cv:
            return self._written

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._wanted > self._written)
                generation = self._wanted
            try:
                write_fence(self.storage, self.root, generation)
            except Exception as e:  # noqa: BLE001 - storage may be out: retried until it lands
                with self._cv:
                    self.last_error = e
                    self._cv.wait(self.backoff_s)  # a newer announcement wakes it sooner
                continue
            with self._cv:
                self._written, self.last_error = max(self._written, generation), None
                self._cv.notify_all()
