"""Fencing: a worker from an older group generation never writes into the run's checkpoints.

A machine that stops and comes back (a thawed freeze, a healed partition)
resumes exactly where it was: in the middle of a persist, say, about to write
a commit marker for a group that no longer exists. The controller bumps the
group generation at every formation and writes it beside the checkpoints
(`<run>/checkpoints/GENERATION`) before the new group forms; a worker checks
it before it writes shards and again right before the commit marker, and
gives up if the run has moved past its generation.

Object stores have no compare-and-swap, so this narrows the window to the
time between the check and the write (milliseconds) rather than closing it;
the generation check on every report the controller reads, and the process
being killed once its node answers again, cover the rest.
"""
from __future__ import annotations

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


def may_write(storage: Storage, checkpoints_root: str, generation: int) -> bool:
    """False only when storage says the run has moved to a newer generation than `generation`.
    An unreadable fence does not stop a current writer (storage trouble is retried elsewhere)."""
    newest = current_generation(storage, checkpoints_root)
    return newest is None or newest <= generation
