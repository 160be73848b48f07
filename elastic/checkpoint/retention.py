"""Retention: which checkpoint folders go after a commit, and how they go.

Kept: the newest `num_to_keep` committed checkpoints that verify, the newest committed folder
(a concurrent reader may be listing it), what a rollback goes back to, and always the newest
checkpoint that was *read back*: every file read from storage and found to match its digest
(`layout.Verdicts`). A commit's own digests come from the local copies it uploaded, so a
checkpoint nobody read back is never the only one left: before the last one read back would go,
the newest kept checkpoint is read back (one full read by rank 0, once every `num_to_keep`
commits), and while that fails nothing older than the last one read back is removed.

Each folder goes one object at a time, its COMMITTED marker first (after that no reader counts
it), and the fence is asked before every object: a driver frozen after one check and thawed
after another took the run over removes at most the object it was about to remove.
"""
from __future__ import annotations

import logging
from typing import Callable

from elastic.checkpoint.layout import (COMMIT_MARKER, VERDICTS, CommittedCheckpoint, Verdicts,
                                       committed_checkpoints, step_of_uri)
from elastic.storage import Storage, StorageError, join

log = logging.getLogger(__name__)

MayDelete = Callable[[], "tuple[bool | None, str] | bool"]  # a fencing.Fence, or anything like it


def apply_retention(storage: Storage, root: str, num_to_keep: int, *, rollback_window: int = 0,
                    verdicts: Verdicts | None = None,
                    may_delete: MayDelete | None = None) -> list[str]:
    """Remove committed checkpoints beyond the newest `num_to_keep` whose contents verify, and
    abandoned partial folders older than the newest committed one. Never removed: the newest
    committed folder, the newest one that verifies, the newest one read back from storage, and
    with `rollback_window` > 0 (train.bad_step=rollback: bad_step_limit - 1), the newest that
    verifies at least that many steps before the newest that verifies: a rollback goes back to the
    newest checkpoint before a run of bad steps, which may have begun up to that many steps ago.
    A folder that fails verification does not count toward `num_to_keep`, so after a restore fell
    back past an unloadable checkpoint, the next commit keeps the loadable ones.
    What is known of each folder comes from `verdicts` (this process's: a commit and a restore note
    theirs); a folder nothing is known of is read once, and only if it is among those that would
    be kept. Newer partial folders may be a persist in flight and are left alone. When nothing
    verifies, or nothing kept could be read back, nothing is removed.
    `may_delete` (the fence: `(True, "")` to go on) is asked before each object removed; any other
    answer stops the pass there. Returns the folders removed whole; removal errors are logged, not
    raised; a storage error while listing or verifying raises (nothing is removed)."""
    verdicts = verdicts or VERDICTS
    committed = committed_checkpoints(storage, root)
    if not committed:
        return []
    while True:
        good = _kept(storage, committed, max(1, num_to_keep), rollback_window, verdicts)
        if not good:
            log.warning("retention: no committed checkpoint under %s verifies; nothing removed",
                        root)
            return []
        anchor = next((c for c in good if verdicts.read_back(c.uri, c.manifest)), None)
        if anchor is not None:
            break
        # None of those kept was read from storage (a commit vouches for what it uploaded, not
        # for what landed): read the newest back before any older one goes.
        problem = verdicts.problem(storage, good[0], read_back=True)
        if problem is None:
            anchor = good[0]
            break
        log.warning("retention: %s does not verify when read back (%s); not counted as kept",
                    good[0].uri, problem)
    keep = {c.uri for c in good}
    listed = {c.uri for c in committed}
    doomed = []
    for name in storage.list_dir(root):
        folder = join(root, name)
        step = step_of_uri(folder)
        if step is None or folder in keep or step >= committed[0].step:
            continue
        if folder in listed and step > anchor.step:
            continue  # nothing newer than it was read back: it may be what a restore falls back to
        doomed.append((step, folder))
    removed = []
    for _, folder in sorted(doomed):  # oldest first
        try:
            if not _remove(storage, folder, may_delete):
                break
            removed.append(folder)
        except StorageError as e:
            log.warning("retention: %s", e)
    return removed


def _kept(storage: Storage, committed: list[CommittedCheckpoint], need: int, rollback_window: int,
          verdicts: Verdicts) -> list[CommittedCheckpoint]:
    """The checkpoints kept because they verify, newest first (see `apply_retention`)."""
    good: list[CommittedCheckpoint] = []
    rollback_kept = rollback_window <= 0
    for c in committed:
        if len(good) >= need and rollback_kept:
            break
        if len(good) >= need and c.step > good[0].step - rollback_window:
            continue  # beyond num_to_keep, and newer than any rollback goes back to
        problem = verdicts.problem(storage, c)
        if problem is not None:
            log.warning("retention: %s does not verify (%s); not counted as kept", c.uri, problem)
            continue
        good.append(c)
        rollback_kept = rollback_kept or good[0].step - c.step >= rollback_window
    return good


def _remove(storage: Storage, folder: str, may_delete: MayDelete | None) -> bool:
    """Remove `folder` one object at a time, COMMITTED first, asking `may_delete` before each;
    False (the folder partly removed, never its files before its marker) at the first no."""
    names = storage.sizes(folder)
    for name in sorted(names, key=lambda n: (n != COMMIT_MARKER, n)):
        ok, why = _allowed(may_delete)
        if not ok:
            log.warning("retention stopped before removing %s/%s: %s", folder, name, why)
            return False
        storage.remove(join(folder, name))
    try:  # the empty directory a local disk keeps; rmdir refuses one that is not empty
        storage.fs.rmdir(storage.fs._strip_protocol(folder))
    except Exception:  # noqa: BLE001 - object stores have no directories; a leftover is harmless
        pass
    return True


def _allowed(may_delete: MayDelete | None) -> tuple[bool, str]:
    if may_delete is None:
        return True, ""
    try:
        answer = may_delete()
    except Exception as e:  # noqa: BLE001 - the right to delete is not confirmed: do not delete
        return False, f"the fence check raised {type(e).__name__}: {e}"
    ok, why = answer if isinstance(answer, tuple) else (answer, "")
    return ok is True, why or "the fence says this worker may no longer write"
