"""Private staging folders on local disk that do not outlive their process.

A remote checkpoint is written by DCP to a staging folder in `TMPDIR` and then uploaded (see
`checkpoint.save_shards`). A worker killed mid-persist (a chaos kill, the OOM killer, a node's
`SIGKILL` on preemption) never runs its `finally`, and its share of the checkpoint stayed on the
node's disk: one checkpoint's share per kill, 600 MB at 100 M parameters and AdamW, until the
disk filled. Each staging folder therefore holds a lock on a file inside it for as long as its
owner lives (`flock`, which the kernel drops when the process dies, in any PID namespace), and
every new staging folder first removes the folders whose lock it can take.

    elastic-stage-XXXXXXXX/
        .owner      locked by the owning process while it lives
        shards/     what the caller writes (and uploads)
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from typing import Iterator

log = logging.getLogger(__name__)

PREFIX = "elastic-stage-"
OWNER = ".owner"
# A folder without an owner file is a layout older than this module, or one whose owner died
# between creating it and locking it (microseconds): left alone until it is this old.
UNOWNED_AFTER_S = 600.0


@contextlib.contextmanager
def stage_folder(parent: str | None = None) -> Iterator[str]:
    """A fresh private folder for this process to write into; removed on exit, and by a later
    `stage_folder` on the same disk if this process dies first. Yields the folder's path."""
    removed = sweep(parent)
    if removed:
        log.info("removed %d staging folder(s) left by dead processes: %s", len(removed), removed)
    top = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    fd = None
    try:
        # Locked under another name, then renamed: a sweeper that finds OWNER finds it locked.
        fd = os.open(os.path.join(top, OWNER + ".new"), os.O_CREAT | os.O_WRONLY, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(os.path.join(top, OWNER + ".new"), os.path.join(top, OWNER))
        shards = os.path.join(top, "shards")
        os.mkdir(shards)
        yield shards
    finally:
        shutil.rmtree(top, ignore_errors=True)
        if fd is not None:
            os.close(fd)


def sweep(parent: str | None = None, now: float | None = None) -> list[str]:
    """Remove the staging folders under `parent` (default `TMPDIR`) whose owner is dead; returns
    them. A folder whose owner lives (its lock is held) is never touched."""
    parent = parent or tempfile.gettempdir()
    now = time.time() if now is None else now
    removed = []
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return removed
    for entry in entries:
        if _owner_dead(entry.path, now):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _owner_dead(folder: str, now: float) -> bool:
    try:
        fd = os.open(os.path.join(folder, OWNER), os.O_RDONLY)
    except FileNotFoundError:
        try:
            return now - os.stat(folder).st_mtime > UNOWNED_AFTER_S
        except OSError:
            return False
    except OSError:
        return False  # not ours to judge (permissions)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its owner lives
    else:
        return True  # the lock is released as the folder is removed (and this fd closed)
    finally:
        os.close(fd)
