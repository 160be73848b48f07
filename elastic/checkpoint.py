"""Sharded checkpoints with a commit protocol, retention and background persist.

Layout, under `<storage_uri>/<run name>/checkpoints/`:

    step_000000040/            one folder per checkpoint, never overwritten
        __0_0.distcp ...       shards, written by torch.distributed.checkpoint
        .metadata              DCP's index, written by its coordinator
        manifest.json          step, data cursor, world size, every file and its size
        COMMITTED              written last, by rank 0, after all of the above are durable

A folder without COMMITTED, or whose files do not match its manifest, does not
exist as far as any reader is concerned (invariant 3). Retention only removes
folders older than the newest committed one.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        return cls(**json.loads(data))


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


# ---------------------------------------------------------------- shards (collective)

def save_shards(state: dict, folder: str, storage_options: dict, process_group) -> None:
    # fsync only means something on local disk; on s3fs files DCP would fall back to a
    # machine-wide os.sync() per file. Never pass checkpoint_id= as well: DCP would rebuild the
    # filesystem from it without the storage options (credentials, endpoint).
    local = folder.startswith("file://")
    dcp.save(state, storage_writer=FsspecWriter(folder, sync_files=local, **storage_options),
             process_group=process_group)


def load_shards(state: dict, folder: str, storage_options: dict, process_group) -> None:
    """Load in place into `state` (tensors are overwritten)."""
    dcp.load(state, storage_reader=FsspecReader(folder, **storage_options), process_group=process_group)


def snapshot(state: Any) -> Any:
    """A private CPU copy of a (nested) state dict, so training can go on while it persists."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return state


@dataclass
class PersistResult:
    step: int
    uri: str
    committed: bool
    persist_s: float
    attempts: int
    error: str | None = None
    metrics: dict = field(default_factory=dict)


class AsyncCheckpointer:
    """Per-rank background persister.

    `save()` takes an in-memory snapshot on the training thread (the only part
    that blocks a step) and hands it to one background thread, which runs the
    collective DCP save on a dedicated process group, retries on storage errors
    (all ranks see the same DCP exception, so they retry in lockstep), and on
    rank 0 writes the manifest and commit marker. A new `save()` first waits
    for the previous persist, so at most one is in flight and every rank issues
    the same collectives in the same order.
    """

    def __init__(self, storage: Storage, root: str, rank: int, world_size: int, strategy: str,
                 process_group, retries: int, backoff_s: float, num_to_keep: int):
        self.storage, self.root = storage, root
        self.rank, self.world_size, self.strategy = rank, world_size, strategy
        self.pg, self.retries, self.backoff_s, self.num_to_keep = process_group, retries, backoff_s, num_to_keep
        self.results: "queue.Queue[PersistResult]" = queue.Queue()
        self._thread: threading.Thread | None = None
        self._abort = threading.Event()

    def abort(self) -> None:
        """The group is being torn down: an in-flight persist stops retrying and is never committed."""
        self._abort.set()

    def wait(self, timeout_s: float | None = None) -> float:
        """Block until the in-flight persist (if any) is done; returns seconds waited.
        With a timeout, a persist stuck on a dead group is abandoned (it can never commit)."""
        t0 = time.monotonic()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        return time.monotonic() - t0

    def save(self, step: int, cursor: int, state: dict, metrics: dict[str, float]) -> float:
        """Snapshot now, persist in the background. Returns the seconds the caller was blocked."""
        t0 = time.monotonic()
        self.wait()
        snap = snapshot(state)
        self._thread = threading.Thread(
            target=self._persist, args=(step, cursor, snap, dict(metrics)), name=f"persist-{step}", daemon=True)
        self._thread.start()
        return time.monotonic() - t0

    def _persist(self, step: int, cursor: int, snap: dict, metrics: dict) -> None:
        folder = step_dir(self.root, step)
        t0 = time.monotonic()
        err = None
        for attempt in range(1, self.retries + 2):
            try:
                save_shards(snap, folder, self.storage.options, self.pg)
                if self.rank == 0:
                    self._commit_with_retries(folder, step, cursor, metrics)
                self.results.put(PersistResult(step, folder, self.rank == 0, time.monotonic() - t0, attempt,
                                               metrics=metrics))
                if self.rank == 0:
                    apply_retention(self.storage, self.root, self.num_to_keep)
                return
            # DCP's CheckpointException is a BaseException, not an Exception.
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - storage and peer errors: retry or report
                err = f"{type(e).__name__}: {e}"
                if self._abort.is_set() or _is_peer_failure(e):
                    break  # the group is gone; the controller will recover, retrying is pointless
                log.warning("persist of step %d failed (attempt %d): %s", step, attempt, err)
                if self._abort.wait(self.backoff_s * 2 ** (attempt - 1)):
                    break
        self.results.put(PersistResult(step, folder, False, time.monotonic() - t0, attempt, err))

    def _commit_with_retries(self, folder: str, step: int, cursor: int, metrics: dict) -> None:
        for attempt in range(self.retries + 1):
            try:
                files = {n: s for n, s in self.storage.sizes(folder).items() if n not in (MANIFEST, COMMIT_MARKER)}
                manifest = Manifest(step, cursor, self.world_size, self.strategy, files, time.time(), metrics)
                commit(self.storage, folder, manifest)
                return
            except StorageError:
                if attempt == self.retries:
                    raise
                time.sleep(self.backoff_s * 2 ** attempt)

    def drain(self) -> list[PersistResult]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out


PEER_LOST = ("connection closed", "connection reset", "broken pipe", "by peer", "not registered")


def _is_peer_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return any(s in text for s in PEER_LOST)
