"""Fencing: a worker from an older group generation never writes into the run's checkpoints.

A machine that stops and comes back (a thawed freeze, a healed partition)
resumes exactly where it was: in the middle of a persist, say, about to write
a commit marker for a group that no longer exists. The controller bumps the
group generation at every formation and announces it beside the checkpoints
before the new group forms (a resubmitted run numbers on from the fence an
earlier submission left); a worker checks the fence before it writes shards
and again right before the commit marker, and gives up if the run has moved
past its generation.

The fence only rises. It is a folder, `<run>/checkpoints/fence/`, with one file
per announced generation (`000001000001`), and the fence is the highest one
there. A write adds a file; it never replaces one. So a late or lapsed writer (a
driver whose lease another driver took over while it was frozen, thawed in the
middle of a recovery; a background write of an outage landing late) adds a lower
file that changes nothing: it can never push the fence back below the rightful
holder's generation and let its own workers commit. Files below the newest are
pruned by the writer once its own has landed (a missing lower file changes
nothing either). On top of that, a controller writes the fence only while its
lease is held and fresh (`FenceWriter(allowed=...)`, elastic/checkpoint/lease.py).

Storage can be out when a group forms (an outage and a lost machine together).
A recovery from the survivors' memory needs no storage, so it does not wait:
the fence is written in the background, retried until it lands, and until it
does the new generation writes no checkpoint either (a worker waits for the
fence to show its own generation), so an older one can never write after a
newer one did.

The fence fails closed: only a fence that can be read and shows the writer's own
generation lets it write. One that cannot be read (storage out, a throttled or
failing LIST, names that are not generations) means "not now", as one that does
not show this generation yet does: the writer asks again within its bound, and
a persist that gives up on an unreadable fence fails as a storage failure does
(its checkpoint stays owed, saved again later), having written nothing. Every write
path asks: a persist before its shards and before its commit, the upload
child before each object and before it completes a multipart upload
(uploader.py), retention before each delete, and the controller before it
un-commits checkpoints (a rollback) or writes metrics.json and ledger.json
(`FenceWriter.holds`).

Object stores have no compare-and-swap, so this narrows the window to the
time between the check and the write (milliseconds, one object) rather than
closing it; the generation check on every report the controller reads, and
the process being killed once its node answers again, cover the rest.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

from elastic.checkpoint.uploader import FENCE_DIGITS, fence_highest
from elastic.storage import Storage, StorageError, join

log = logging.getLogger(__name__)

FENCE = "fence"  # the folder of announced generations, beside the checkpoints
UNREADABLE = "the fence cannot be read"  # how every "why" of an unreadable fence begins


class FenceUnreadable(StorageError):
    """The fence cannot be listed, or holds a name that is not a generation."""


def fence_uri(checkpoints_root: str) -> str:
    return join(checkpoints_root, FENCE)


def generation_name(generation: int) -> str:
    return f"{generation:0{FENCE_DIGITS}d}"


def highest(names: Iterable[str], where: str) -> int | None:
    """The fence a listing of its folder shows: its highest generation, None for none. A name
    that is not a generation (something else wrote into the folder) makes it unreadable: it
    fails closed rather than guess."""
    try:
        return fence_highest(list(names))
    except ValueError as e:
        raise FenceUnreadable(f"{UNREADABLE}: {where} holds {e}") from e


def write_fence(storage: Storage, checkpoints_root: str, generation: int) -> None:
    """Add `generation` to the fence. It never lowers it: a lower generation's file changes
    nothing while a higher one is there."""
    storage.write_bytes(join(fence_uri(checkpoints_root), generation_name(generation)),
                        str(generation).encode())


def read_fence(storage: Storage, checkpoints_root: str) -> int | None:
    """The generation the fence shows (the highest announced); None when none was written yet.
    `FenceUnreadable` when storage does not answer with one (an error, a throttled LIST, a name
    that is not a generation)."""
    uri = fence_uri(checkpoints_root)
    try:
        names = storage.list_dir(uri)
    except StorageError as e:
        raise FenceUnreadable(f"{UNREADABLE}: {e}") from e
    return highest(names, uri)


def prune_below(storage: Storage, checkpoints_root: str, generation: int) -> None:
    """Remove the fence's files below `generation` (best effort: a lower file changes nothing,
    so one left behind is harmless). Never touches `generation` or anything above it."""
    uri = fence_uri(checkpoints_root)
    for name in storage.list_dir(uri):
        if name.isdigit() and int(name) < generation:
            storage.remove(join(uri, name))


def current_generation(storage: Storage, checkpoints_root: str) -> int | None:
    """The newest generation the controller announced; None if none was (or it can't be read)."""
    try:
        return read_fence(storage, checkpoints_root)
    except FenceUnreadable:
        return None


def may_write(storage: Storage, checkpoints_root: str, generation: int) -> tuple[bool | None, str]:
    """(allowed, why not). True only when the fence shows `generation`. False when it shows a
    newer one: the run has moved on, for good. None (not now: ask again) while it shows an older
    one or none, because the controller's write of this generation's fence has not landed
    (storage was out when the group formed), and while it cannot be read: an unreadable fence
    never lets a writer write (`unreadable(why)` tells that case apart)."""
    try:
        newest = read_fence(storage, checkpoints_root)
    except FenceUnreadable as e:
        return None, str(e)
    if newest == generation:
        return True, ""
    if newest is not None and newest > generation:
        return False, f"the run has moved on to generation {newest} (this worker's: {generation})"
    shows = f"still shows generation {newest}" if newest is not None else "is not written yet"
    return None, f"the fence {shows}: the controller's write of generation {generation} has not landed"


def unreadable(why: str) -> bool:
    """Whether a "not now" of `may_write` is storage not answering (a write given up for it
    leaves the checkpoint owed) rather than this generation's fence not landed yet."""
    return why.startswith(UNREADABLE)


@dataclass(frozen=True)
class Fence:
    """One generation's right to write: `may_write` bound to it (call it), and where the fence
    is, for a process that checks it on its own (the upload child, before each object)."""

    storage: Storage
    checkpoints_root: str
    generation: int

    def __call__(self) -> tuple[bool | None, str]:
        return may_write(self.storage, self.checkpoints_root, self.generation)

    @property
    def uri(self) -> str:
        """The fence's folder: list it, and `highest` of the names is the fence."""
        return fence_uri(self.checkpoints_root)


def always_allowed() -> tuple[bool, str]:
    return True, ""


class FenceWriter:
    """Writes the newest generation announced, in order, on one background thread, retrying a
    failed write until it lands or a newer generation replaces it. `announce` waits at most
    `wait_s` for the write and says whether it landed; a storage that hangs holds up no more.

    `allowed()` -> (ok, why not) is asked before every write and every `holds`: the controller
    passes its lease's freshness, so a driver whose lease lapsed (frozen, or cut off from storage
    for longer than run.lease_ttl_s) writes no fence until a renewal lands again, and one whose
    lease was taken over never does."""

    def __init__(self, storage: Storage, checkpoints_root: str, backoff_s: float = 1.0,
                 allowed: Callable[[], tuple[bool, str]] = always_allowed):
        self.storage, self.root, self.backoff_s, self.allowed = storage, checkpoints_root, backoff_s, allowed
        self.last_error: BaseException | str | None = None  # of the last failed or refused write
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

    def holds(self) -> tuple[bool, str]:
        """(whether the controller still holds the run, why not), as its lease and the fence tell
        it: the lease is fresh and the fence shows the newest generation this writer announced,
        or the newest it landed (a newer one's write still pending). Asked before the
        controller's own writes into the run's folder. Fails closed: a stale lease, or a fence
        that cannot be read, is missing or shows another generation, says no. A fence found
        below this writer's generation (its file removed from storage) is written again."""
        ok, why = self.allowed()
        if not ok:
            return False, why
        with self._cv:
            wanted, written = self._wanted, self._written
        if not wanted:
            return False, "this controller has announced no generation yet"
        try:
            shown = read_fence(self.storage, self.root)
        except FenceUnreadable as e:
            return False, str(e)
        if shown is not None and shown in (wanted, written):
            return True, ""
        if shown is None or shown < written:
            self._rewrite()
        return False, (f"the fence shows generation {shown}, not this controller's ({wanted})" if shown is not None
                       else f"the fence is not there (this controller's generation: {wanted})")

    def _rewrite(self) -> None:
        """The fence shows less than this writer landed: its file is gone (a lifecycle rule, a
        clean-up). Write the newest announced again."""
        with self._cv:
            self._written = 0
            self._cv.notify_all()
        log.warning("the fence in %s shows less than generation %d: writing it again", self.root, self._wanted)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._wanted > self._written)
                generation = self._wanted
            try:
                ok, why = self.allowed()
                if not ok:
                    raise _Refused(why)
                write_fence(self.storage, self.root, generation)
            except Exception as e:  # noqa: BLE001 - storage may be out, the lease stale: retried
                with self._cv:
                    self.last_error = e
                    self._cv.wait(self.backoff_s)  # a newer announcement wakes it sooner
                continue
            with self._cv:
                self._written, self.last_error = max(self._written, generation), None
                self._cv.notify_all()
            try:
                prune_below(self.storage, self.root, generation)
            except StorageError as e:  # harmless: a lower file changes nothing
                log.info("fence files below generation %d not pruned: %s", generation, e)


class _Refused(RuntimeError):
    """The lease does not let this controller write the fence now (lapsed or lost)."""

