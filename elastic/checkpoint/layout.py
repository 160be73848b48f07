"""Sharded checkpoints with a commit protocol, retention and background persist.

Layout, under `<storage_uri>/<run name>/checkpoints/`:

    step_000000040/            one folder per checkpoint, never overwritten
        __0_0.distcp ...       shards, written by torch.distributed.checkpoint
        .metadata              DCP's index, written by its coordinator
        manifest.json          step, data cursor and what the sample order depends on, world size,
                               every file this save wrote and its size
        COMMITTED              written last, by rank 0, after all of the above are durable

A folder without COMMITTED, or whose files do not match its manifest, does not
exist as far as any reader is concerned (invariant 3). Retention only removes
folders older than the newest committed one.

A committed folder is never written again: a step redone after a recovery finds
its folder committed and reports that commit instead of saving (the redone state
equals the saved one, invariant 1). An uncommitted folder of that step is left
over from a lost attempt: it is removed before the save, and the manifest lists
only the files this save's DCP metadata names, so a stray file can never become
part of a checkpoint.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

from elastic.storage import Storage, StorageError, join

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
_PREFIX = "step_"


def checkpoints_root(storage_uri: str, run_name: str) -> str:
    return join(storage_uri, run_name, "checkpoints")


def step_dir(root: str, step: int) -> str:
    return join(root, f"{_PREFIX}{step:09d}")


def _step_of(name: str) -> int | None:
    if not name.startswith(_PREFIX):
        return None
    try:
        return int(name[len(_PREFIX):])
    except ValueError:
        return None


@dataclass(frozen=True)
class Manifest:
    step: int
    cursor: int
    world_size: int
    strategy: str
    files: dict[str, int]
    created_at: float
    metrics: dict[str, float] = field(default_factory=dict)
    # What the global sample order depends on (see elastic.data.order): global_batch_size, seed,
    # num_samples. A resume with other values would train on another order. Empty in manifests
    # written before it was recorded; those are loaded without the check.
    data_order: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("manifest is not a JSON object")
        # Fields a newer version added are ignored rather than fatal: the checkpoint still loads.
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


@dataclass(frozen=True)
class CommittedCheckpoint:
    uri: str
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


def commit(storage: Storage, folder: str, manifest: Manifest) -> None:
    """Manifest, then the marker: the marker's presence means everything else is durable."""
    storage.write_bytes(join(folder, MANIFEST), manifest.to_json())
    storage.write_bytes(join(folder, COMMIT_MARKER), str(manifest.step).encode())


def validate(storage: Storage, folder: str) -> Manifest:
    """The folder's manifest if the folder is committed and intact; ValueError saying why not."""
    names = storage.sizes(folder)
    if COMMIT_MARKER not in names:
        raise ValueError("no commit marker (persist did not finish)")
    try:
        manifest = Manifest.from_json(storage.read_bytes(join(folder, MANIFEST)))
    except (StorageError, ValueError, TypeError) as e:
        raise ValueError(f"manifest unreadable: {e}") from e
    for name, size in manifest.files.items():
        if name not in names:
            raise ValueError(f"file {name} listed in the manifest is missing")
        if names[name] != size:
            raise ValueError(f"file {name} has {names[name]} bytes, manifest says {size}")
    return manifest


def committed_checkpoints(
    storage: Storage, root: str, on_skip: Callable[[str, str], None] | None = None
) -> list[CommittedCheckpoint]:
    """Committed, intact checkpoints, newest first. `on_skip(uri, reason)` hears about the rest."""
    out = []
    for name in sorted(storage.list_dir(root), reverse=True):
        if _step_of(name) is None:
            continue
        folder = join(root, name)
        try:
            out.append(CommittedCheckpoint(folder, validate(storage, folder)))
        except ValueError as e:
            if on_skip:
                on_skip(folder, str(e))
    return out


def latest_committed(storage: Storage, root: str, on_skip=None) -> CommittedCheckpoint | None:
    found = committed_checkpoints(storage, root, on_skip)
    return found[0] if found else None


def abandon_after(storage: Storage, root: str, step: int) -> list[str]:
    """Un-commit the checkpoints after `step` (a rollback abandons their timeline): their commit
    markers go, so they are never restored and a redone step writes its own. Returns them."""
    out = []
    for c in committed_checkpoints(storage, root):
        if c.step > step:
            storage.remove(join(c.uri, COMMIT_MARKER))
            out.append(c.uri)
    return out


def apply_retention(storage: Storage, root: str, num_to_keep: int) -> list[str]:
    """Remove committed checkpoints beyond the newest `num_to_keep`, and abandoned partial
    folders older than the newest committed one. Newer partial folders may be a persist in
    flight and are left alone. Returns what was removed; removal errors are logged, not raised."""
    committed = committed_checkpoints(storage, root)
    if not committed:
        return []
    keep = {c.uri for c in committed[:max(1, num_to_keep)]}
    newest_step = committed[0].step
    removed = []
    for name in storage.list_dir(root):
        step = _step_of(name)
        folder = join(root, name)
        if step is None or folder in keep or step >= newest_step:
            continue
        try:
            storage.remove_tree(folder)
            removed.append(folder)
        except StorageError as e:
            log.warning("retention: %s", e)
    return removed
