"""How the ranks of a checkpoint group agree before a persist writes anything, and whether this
rank may still write: a mixin of `AsyncCheckpointer` (elastic/checkpoint/persister.py), whose
state it reads (`storage`, `root`, `rank`, `pg`, `may_write`, `retries`, `backoff_s`, `_after`,
`_stop`, `_gave_up`, `_wait_timeout_s`).

One tiny all-reduce carries rank 0's look at the step's folder (`_inspect`), whether any rank is
fenced off (`_allowed`: the run's fence, elastic/checkpoint/fencing.py) and whether any still runs
an upload an earlier group abandoned, so every rank takes the same path through the collective
save that follows.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from elastic.checkpoint import fencing
from elastic.checkpoint.layout import COMMIT_MARKER, VERDICTS, Manifest, validate
from elastic.storage import StorageError

log = logging.getLogger(__name__)

# What rank 0 finds in a step's folder before saving into it, shared with every rank so that all
# of them take the same path through the collective save.
EMPTY, COMMITTED, STALE, BROKEN, UNREADABLE = range(5)
FENCED = -1  # some rank may no longer write: nobody does
LATE = -2  # some rank's upload for a failed group still runs: nobody writes this time


class Fenced(RuntimeError):
    """`may_write` said no: this worker may no longer write to the run's storage."""


class PersistAgreement:
    """The agreement and write-permission half of `AsyncCheckpointer` (see the module's docstring)."""

    def _allowed(self, deadline: float | None = None) -> tuple[bool | None, str]:
        """Whether this rank may write: (True, ""), or (False, why) when it may not (fenced off, or
        its fence not landed), or (None, why) when the fence could not be read: not a verdict,
        but no permission either (fail closed). Until `deadline` (monotonic), a fence not landed
        is asked again every 0.5 s, and an unreadable one as a failed write is retried: at most
        `retries` times, after `backoff_s`, doubling (a storage that refuses every request
        fails the persist in seconds, not at the deadline, and its checkpoint stays owed)."""
        if self.may_write is None:
            return True, ""
        num_unreadable = 0
        while True:
            try:
                answer = self.may_write()
            except Exception as e:  # noqa: BLE001 - unable to confirm the right to write: do not write
                return False, f"may_write() raised {type(e).__name__}: {e}"
            ok, why = answer if isinstance(answer, tuple) else (answer, "")
            if ok:
                return True, ""
            unreadable = ok is None and fencing.unreadable(why)
            if ok is None and deadline is not None and time.monotonic() < deadline and not (
                    unreadable and num_unreadable >= self.retries):
                wait_s = self.backoff_s * 2 ** num_unreadable if unreadable else 0.5
                num_unreadable += unreadable
                if self._stop.wait(min(wait_s, max(0.0, deadline - time.monotonic()))):
                    if self._gave_up is not None:  # not a "no": the checkpoint stays owed
                        return None, f"the persist was given up while waiting ({self._gave_up}): {why}"
                    return False, "the group failed while waiting: " + why
                continue
            if unreadable:
                return None, why
            return False, why or "may_write() said this worker may no longer write"

    def _fence(self) -> tuple[str, int] | None:
        """What the upload checks before each object: the fence's URI and this group's generation."""
        f = self.may_write
        return (f.uri, f.generation) if isinstance(f, fencing.Fence) else None

    def _any_rank_fenced(self, mine: bool) -> bool:
        """Whether any rank's upload found the run moved on: every rank then stops retrying at
        once, or the others would wait in the next attempt's collective for one that left."""
        flag = torch.tensor([int(mine)], dtype=torch.int64)
        dist.all_reduce(flag, group=self.pg)
        return bool(int(flag[0]))

    def _earlier_still_running(self, deadline: float) -> bool:
        """Wait (until `deadline`) for the persists earlier groups abandoned; True if one still runs."""
        for ck in self._after:
            ck.wait(max(0.0, deadline - time.monotonic()))
        self._after = [ck for ck in self._after if ck.in_flight()]
        return bool(self._after)

    def _agree(self, folder: str, step: int) -> tuple[int, str, Manifest | None]:
        """(verdict, detail, manifest of a committed folder), the same verdict on every rank:
        one tiny all-reduce on the checkpoint group carries rank 0's look at the folder, whether
        any rank is fenced and whether any still runs an upload an earlier group abandoned. Each
        rank first waits, within one bound, for those uploads and for its group's fence."""
        deadline = time.monotonic() + self._wait_timeout_s
        late = self._earlier_still_running(deadline)
        ok, why = self._allowed(deadline)
        verdict, detail, found = EMPTY, "", None
        if self.rank == 0 and ok and not late:
            verdict, detail, found = self._inspect(folder, step)
        flags = torch.tensor([int(ok is False), verdict if self.rank == 0 else 0, int(late), int(ok is None)],
                             dtype=torch.int64)
        dist.all_reduce(flags, group=self.pg)
        num_fenced, verdict, num_late, num_unread = (int(f) for f in flags)
        if num_fenced:
            who = f"rank {self.rank}: {why}" if ok is False else f"{num_fenced} rank(s) of the group may no longer write"
            return FENCED, f"fenced: {who}; persist of {folder} abandoned, nothing written", None
        if num_unread:
            # Fail closed, but not for good: a storage failure, so the checkpoint stays owed.
            who = f"rank {self.rank}: {why}" if ok is None else f"{num_unread} rank(s) could not read the fence"
            return UNREADABLE, (f"{who} (for {self._wait_timeout_s:.0f} s); nothing of {folder} written, "
                                 f"saved again once storage answers"), None
        if num_late:
            return LATE, (f"skipped: {num_late} rank(s) still upload a persist their failed group abandoned "
                           f"(after {self._wait_timeout_s:.0f} s); nothing of {folder} written, the next "
                           f"checkpoint tries again"), None
        return verdict, detail, found

    def _inspect(self, folder: str, step: int) -> tuple[int, str, Manifest | None]:
        """Rank 0's look at the step's folder before a save (removing what a lost attempt left)."""
        name = folder.rsplit("/", 1)[1]
        for attempt in range(self.retries + 1):
            try:
                if name not in self.storage.list_dir(self.root):
                    return EMPTY, "", None
                if COMMIT_MARKER not in self.storage.sizes(folder):
                    try:
                        self.storage.remove_tree(folder)  # left over by a lost attempt at this step
                    except StorageError as e:
                        # The manifest lists only what this save writes, so leftovers can stay.
                        log.warning("leftovers of an earlier attempt at step %d not removed: %s", step, e)
                    return STALE, "", None
                try:
                    found = validate(self.storage, folder)
                    # A folder this process's restore found corrupt: reporting it as this step's
                    # commit would name it as the run's last committed checkpoint.
                    _, problem = VERDICTS.known(folder, found)
                    if problem is not None:
                        raise ValueError(problem)
                    return COMMITTED, "", found
                except ValueError as e:
                    return BROKEN, (f"{folder} holds a {COMMIT_MARKER} marker but is not a valid checkpoint "
                                     f"({e}); a committed folder is never rewritten, so step {step} is not "
                                     f"checkpointed again (readers skip that folder)"), None
            except StorageError as e:
                if attempt == self.retries or self._stop.wait(self.backoff_s * 2 ** attempt):
                    return UNREADABLE, f"cannot look at {folder} before saving: {e}", None
        raise AssertionError("unreachable")
