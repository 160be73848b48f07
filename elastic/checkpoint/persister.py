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

import asyncio
import concurrent.futures
import json
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Sequence

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from elastic.checkpoint import uploader
from elastic.checkpoint.staging import stage_folder
from elastic.storage import Storage, StorageError, join
from elastic.checkpoint.uploader import UploadCut
from elastic.protocol import PersistResult

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


# ---------------------------------------------------------------- shards (collective)

# Remote uploads run in a child process (elastic/uploader.py), not beside training's thread in the
# worker's: False uploads in the worker (for an A/B of the two). Process-private filesystems
# (`_process_private`: memory://) always upload in the worker, the only process that sees them.
UPLOAD_IN_CHILD = True


def save_shards(state: dict, folder: str, storage_options: dict, process_group,
                on_write: Callable[[], None] | None = None, cancel: threading.Event | None = None,
                on_cuttable: Callable[[], None] | None = None):
    """Collective DCP save into `folder`; returns DCP's index (Metadata) of what it wrote.
    `on_write` is called when this rank starts writing to `folder` itself (after the collective
    planning; for a remote folder, when the upload of the staged files begins). `cancel` set
    during the upload cuts it short (`UploadCut`; see `upload`); `on_cuttable` is called when an
    upload that can be cut begins.
    A save into an existing folder overwrites files of the same name and leaves the others.

    Local disk (file://): DCP writes the folder itself. Anything else (S3, GCS, ...): DCP writes
    this rank's files to a private staging folder on local disk (`staging.stage_folder`: removed
    afterwards, or by a later save on the node if this process is killed first), which is then
    uploaded with the filesystem's own `put`, in a child process (`uploader.put`: off the GIL
    that training's thread holds; in this process for the worker's first upload, or while its
    child is busy). DCP serializing straight into s3fs file buffers copies every tensor
    through Python bytes objects while holding the GIL (up to 0.3 s at a time for a 400 MB
    tensor), which stalled training and the controller's polls for seconds at 100 M parameters
    (a false "unresponsive" verdict); a local file and `put` hold it for tens of ms at most.
    Every rank learns whether every upload succeeded (an all-reduce), so all of them raise or
    none does and the caller's retries stay in lockstep."""
    if folder.startswith("file://"):
        # Never pass checkpoint_id= as well: DCP would rebuild the filesystem from it without
        # the storage options.
        writer = (FsspecWriter(folder, sync_files=True, **storage_options) if on_write is None
                  else _NotifyingWriter(on_write, folder, sync_files=True, **storage_options))
        return dcp.save(state, storage_writer=writer, process_group=process_group)
    with stage_folder() as stage:
        # No fsync: the staged copy is only read back by the upload, never after a crash.
        metadata = dcp.save(state, storage_writer=FileSystemWriter(stage, sync_files=False),
                            process_group=process_group)
        error = None
        try:
            if on_write:
                on_write()
            fs, path = fsspec.core.url_to_fs(folder, **storage_options)
            in_child = UPLOAD_IN_CHILD and not _process_private(fs)
            if not (in_child and uploader.put(stage, folder, storage_options, cancel, on_cuttable=on_cuttable)):
                # No child idle (this worker's first upload, or its child busy): in this process,
                # then a child is started for the next upload.
                upload(fs, stage.rstrip("/") + "/", path.rstrip("/") + "/", cancel, on_cuttable=on_cuttable)
                if in_child:
                    uploader.prestart(folder, storage_options)
        except UploadCut:
            raise  # the group is gone: nothing collective follows
        except Exception as e:  # noqa: BLE001 - made collective below, then raised on every rank
            error = e
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized():  # else a single process, as DCP allows
            dist.all_reduce(failed, group=process_group)
        if error is not None:
            raise error
        if int(failed[0]):
            raise StorageError(f"another rank's upload of its shards to {folder} failed; retrying together")
        return metadata


def _process_private(fs) -> bool:
    """A filesystem a child process could not reach: this process's memory (memory:// and its
    kind), or a class registered at run time (`fsspec.register_implementation`), which a fresh
    interpreter lacks. Filesystems fsspec knows by name (s3, gcs, abfs, file, and plugins'
    entry points) are reachable."""
    from fsspec.implementations.memory import MemoryFileSystem
    from fsspec.registry import known_implementations
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return isinstance(fs, MemoryFileSystem) or not any(p in known_implementations for p in protocols)


def upload(fs, src: str, dst: str, cancel: threading.Event | None = None, poll_s: float = 0.05,
           on_cuttable: Callable[[], None] | None = None) -> None:
    """In this process (`uploader.put` is the child's): `fs.put(src, dst, recursive=True)`, cut
    short within `poll_s` once `cancel` is set, on an async filesystem (s3fs, gcsfs, adlfs): its
    coroutine is cancelled on fsspec's event loop, which drops the connection mid-request
    (`on_cuttable` is called as such an upload begins). A synchronous filesystem uploads to the end.
    A multipart upload cut short stays incomplete in the bucket, invisible to readers, until
    the store's lifecycle rule for incomplete uploads removes it."""
    if cancel is None or not getattr(fs, "async_impl", False):
        fs.put(src, dst, recursive=True)
        return
    if cancel.is_set():
        raise UploadCut(f"upload of {dst} not begun")
    future = asyncio.run_coroutine_threadsafe(fs._put(src, dst, recursive=True), fs.loop)
    if on_cuttable:
        on_cuttable()
    while True:
        try:
            future.result(timeout=poll_s)
            return
        except concurrent.futures.TimeoutError:
            if cancel.is_set():
                future.cancel()
                raise UploadCut(f"upload of {dst} cut short") from None


class _NotifyingWriter(FsspecWriter):
    """DCP's fsspec writer that says when it starts writing this rank's files."""

    def __init__(self, on_write: Callable[[], None], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_write = on_write

    def write_data(self, plan, planner):
        self.on_write()
        return super().write_data(plan, planner)


def load_shards(state: dict, folder: str, storage_options: dict, process_group) -> None:
    """Load in place into `state` (tensors are overwritten)."""
    dcp.load(state, storage_reader=FsspecReader(folder, **storage_options), process_group=process_group)


def snapshot(state: Any, reuse: Any = None) -> Any:
    """A private CPU copy of a (nested) state dict, so training can go on while it persists.
    `reuse`: the previous snapshot (its persist finished): plain tensors of the same shape and
    dtype are copied into in place, so staging does not allocate (and fault in) fresh memory
    at every checkpoint; GPU state is staged in pinned memory."""
    if isinstance(state, torch.Tensor):
        src = state.detach()
        if type(src) is torch.Tensor:  # a DTensor (FSDP) is copied whole
            if (type(reuse) is torch.Tensor and reuse.shape == src.shape and reuse.dtype == src.dtype
                    and reuse.device.type == "cpu"):
                return reuse.copy_(src)
            if src.is_cuda:
                return torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
        return src.to("cpu", copy=True)
    if isinstance(state, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: snapshot(v, old.get(k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(state) else [None] * len(state)
        return type(state)(snapshot(v, o) for v, o in zip(state, old))
    return state


def staging_for(state: Any) -> Any:
    """Empty CPU buffers for a later `snapshot(state, reuse=...)`, shaped like the plain tensors
    of `state` (pinned for GPU tensors), their pages faulted in now. Reads no tensor's data, only
    shapes and dtypes, so it may run while training changes them. A first snapshot into fresh
    memory took 1.35 s for the state of a 102.7 M-parameter MLP with AdamW on an idle core here,
    against 0.06 s into buffers already touched (`snapshot` reuse); in a training worker on a
    shared core it stopped the checkpoint's step for seconds. DTensors (copied whole by
    `snapshot`) and everything else get None."""
    if isinstance(state, torch.Tensor):
        src = state.detach()
        if type(src) is not torch.Tensor:
            return None
        buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
        return buf.zero_()  # the kernel hands out pages on first touch: touch them here
    if isinstance(state, dict):
        return {k: staging_for(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(staging_for(v) for v in state)
    return None


# What rank 0 finds in a step's folder before saving into it, shared with every rank so that all
# of them take the same path through the collective save.
_EMPTY, _COMMITTED, _STALE, _BROKEN, _UNREADABLE = range(5)
_FENCED = -1  # some rank may no longer write: nobody does
_LATE = -2  # some rank's upload for a failed group still runs: nobody writes this time
DCP_METADATA = ".metadata"  # DCP's index of a save, written last by its coordinator


class Fenced(RuntimeError):
    """`may_write` said no: this worker may no longer write to the run's storage."""


class AsyncCheckpointer:
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
                 staged: Any = None):
        """`data_order`: what the run's sample order depends on (global_batch_size, seed,
        num_samples), stored in every manifest so a resume can refuse another order.
        `may_write`: asked before the shard save and again before the commit; False, (False,
        why) or an exception abandons the persist, reported with an error starting "fenced:".
        (None, why) means not yet (this group's fence has not landed): asked again until it
        says yes or no, within the wait bound below, before the save; refused at the commit.
        `after`: checkpointers of this process's earlier groups whose persist was abandoned while
        still uploading. Each persist first waits for them: a late upload of theirs must never
        land on a file this one wrote. If one still runs on any rank, every rank skips that
        persist ("skipped:").
        `wait_timeout_s`: the most a persist waits for both, in its background thread, before
        the ranks agree; keep it well under the checkpoint group's collective timeout.
        `staged`: staging buffers to copy the first snapshot into (`spare_buffers()` of this
        process's previous checkpointer, or None)."""
        self.storage, self.root = storage, root
        self.rank, self.world_size, self.strategy = rank, world_size, strategy
        self.pg, self.retries, self.backoff_s, self.num_to_keep = process_group, retries, backoff_s, num_to_keep
        self.data_order = dict(data_order or {})
        self.may_write = may_write
        self.results: "queue.Queue[PersistResult]" = queue.Queue()
        self._thread: threading.Thread | None = None
        self._abort = threading.Event()
        self._aborted_at = 0.0
        self._staged = staged  # the last snapshot: its buffers are reused once its persist is done
        self._prestage: threading.Thread | None = None
        self._prestaged = None
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
        """No staging buffers yet, and none being made: `prestage` would make them."""
        return self._staged is None and self._prestage is None

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

    def save(self, step: int, cursor: int, state: dict, metrics: dict[str, float]) -> float:
        """Snapshot now, persist in the background. Returns the seconds the caller was blocked."""
        t0 = time.monotonic()
        self.wait()
        if self._prestage is not None and self._staged is None:
            self._prestage.join()
            self._staged, self._prestaged = self._prestaged, None
        snap = self._staged = snapshot(state, self._staged)
        stall_s = time.monotonic() - t0
        self.step_in_flight = step
        self.writing = threading.Event()
        self.cuttable = threading.Event()
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
        if verdict in (_FENCED, _LATE):
            return report(error=detail)
        if verdict == _COMMITTED:
            # A redone step (recovery from storage): its folder was committed by the attempt that
            # was lost, with the state this attempt recomputed. Never rewritten in place.
            return report(committed=self.rank == 0, reused=True,
                          metrics_=found.metrics if found is not None else metrics)
        if verdict in (_BROKEN, _UNREADABLE):
            return report(error=detail or f"rank 0 could not prepare {folder}; nothing saved")

        # 2. Shards, collectively: retried in lockstep, because DCP raises on every rank.
        metadata, err, attempt = None, None, 0
        for attempt in range(1, self.retries + 2):
            try:
                metadata = save_shards(snap, folder, self.storage.options, self.pg, on_write=writing.set,
                                       cancel=self._abort, on_cuttable=cuttable.set)
                err = None
                break
            except UploadCut:
                return report(attempts=attempt, error=f"abandoned: the group failed during the upload, cut "
                                                      f"short {time.monotonic() - self._aborted_at:.2f} s after; "
                                                      f"never committed")
            # DCP's CheckpointException is a BaseException, not an Exception.
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - storage and peer errors: retry or report
                err = f"{type(e).__name__}: {e}"
                if self._abort.is_set() or _is_peer_failure(e):
                    break  # the group is gone; the controller will recover, retrying is pointless
                log.warning("persist of step %d failed (attempt %d): %s", step, attempt, err)
                if attempt > self.retries or self._abort.wait(self.backoff_s * 2 ** (attempt - 1)):
                    break
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
            self._commit_with_retries(folder, step, cursor, metrics, metadata)
        except (StorageError, Fenced) as e:
            return report(attempts=attempt, error=str(e))
        report(committed=True, attempts=attempt, metrics_=metrics)
        try:
            apply_retention(self.storage, self.root, self.num_to_keep)
        except Exception as e:  # noqa: BLE001 - old folders stay until the next pass; the commit stands
            log.warning("retention after step %d failed (next checkpoint retries): %s", step, e)

    def _allowed(self, deadline: float | None = None) -> tuple[bool, str]:
        """Whether this rank may write; a "not yet" is asked again until `deadline` (monotonic)."""
        if self.may_write is None:
            return True, ""
        while True:
            try:
                answer = self.may_write()
            except Exception as e:  # noqa: BLE001 - unable to confirm the right to write: do not write
                return False, f"may_write() raised {type(e).__name__}: {e}"
            ok, why = answer if isinstance(answer, tuple) else (answer, "")
            if ok:
                return True, ""
            if ok is None and deadline is not None and time.monotonic() < deadline:
                if self._abort.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
                    return False, "the group failed while waiting: " + why
                continue
            return False, why or "may_write() said this worker may no longer write"

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
        verdict, detail, found = _EMPTY, "", None
        if self.rank == 0 and ok and not late:
            verdict, detail, found = self._inspect(folder, step)
        flags = torch.tensor([0 if ok else 1, verdict if self.rank == 0 else 0, int(late)], dtype=torch.int64)
        dist.all_reduce(flags, group=self.pg)
        num_fenced, verdict, num_late = int(flags[0]), int(flags[1]), int(flags[2])
        if num_fenced:
            who = f"rank {self.rank}: {why}" if not ok else f"{num_fenced} rank(s) of the group may no longer write"
            return _FENCED, f"fenced: {who}; persist of {folder} abandoned, nothing written", None
        if num_late:
            return _LATE, (f"skipped: {num_late} rank(s) still upload a persist their failed group abandoned "
                           f"(after {self._wait_timeout_s:.0f} s); nothing of {folder} written, the next "
                           f"checkpoint tries again"), None
        return verdict, detail, found

    def _inspect(self, folder: str, step: int) -> tuple[int, str, Manifest | None]:
        """Rank 0's look at the step's folder before a save (removing what a lost attempt left)."""
        name = folder.rsplit("/", 1)[1]
        for attempt in range(self.retries + 1):
            try:
                if name not in self.storage.list_dir(self.root):
                    return _EMPTY, "", None
                if COMMIT_MARKER not in self.storage.sizes(folder):
                    try:
                        self.storage.remove_tree(folder)  # left over by a lost attempt at this step
                    except StorageError as e:
                        # The manifest lists only what this save writes, so leftovers can stay.
                        log.warning("leftovers of an earlier attempt at step %d not removed: %s", step, e)
                    return _STALE, "", None
                try:
                    return _COMMITTED, "", validate(self.storage, folder)
                except ValueError as e:
                    return _BROKEN, (f"{folder} holds a {COMMIT_MARKER} marker but is not a valid checkpoint "
                                     f"({e}); a committed folder is never rewritten, so step {step} is not "
                                     f"checkpointed again (readers skip that folder)"), None
            except StorageError as e:
                if attempt == self.retries or self._abort.wait(self.backoff_s * 2 ** attempt):
                    return _UNREADABLE, f"cannot look at {folder} before saving: {e}", None
        raise AssertionError("unreachable")

    def _commit_with_retries(self, folder: str, step: int, cursor: int, metrics: dict, metadata) -> None:
        """Manifest then marker, on rank 0, after every rank's shards are written (DCP said so).
        The manifest is built once, so a retry writes the same bytes."""
        wrote = _written_files(metadata)
        manifest = None
        for attempt in range(self.retries + 1):
            ok, why = self._allowed()
            if not ok:
                raise Fenced(f"fenced: rank 0: {why}; {folder} not committed")
            try:
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
                                        self.data_order)
                commit(self.storage, folder, manifest)
                return
            except StorageError as e:
                if attempt == self.retries or self._abort.wait(self.backoff_s * 2 ** attempt):
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


def _written_files(metadata) -> set[str] | None:
    """The files a DCP save wrote, from the index it returned: shards named in `storage_data`
    plus the index itself. None when the index does not say."""
    storage_data = getattr(metadata, "storage_data", None)
    if storage_data is None:
        return None
    return {info.relative_path for info in storage_data.values()} | {DCP_METADATA}


PEER_LOST = ("connection closed", "connection reset", "broken pipe", "by peer", "not registered")


RETRY_WAIT_MAX_S = 60.0  # the longest a failed checkpoint waits before it is saved again


def owes_retry(error: str) -> bool:
    """Whether a persist that failed with `error` leaves a checkpoint owed, to be saved again once
    storage answers: a storage failure. Not a persist given up with its group (`abandoned:`: the
    next group's restore decides), one fenced off (`fenced:`: a newer generation writes) or one
    skipped for an earlier group's upload (`skipped:`: the next checkpoint step saves)."""
    return not error.startswith(("abandoned", "fenced", "skipped"))


def retry_wait_s(backoff_s: float, failed_retries: int) -> float:
    """How long after a failed persist the checkpoint is saved again: checkpoint.persist_retry_
    backoff_s, doubled by each retry that failed too, at most RETRY_WAIT_MAX_S. (A persist has
    already spent its own retries before it fails: this paces the saves, each a snapshot.)"""
    return min(RETRY_WAIT_MAX_S, backoff_s * 2 ** failed_retries)


def describe_failure(e: BaseException, limit: int = 300) -> str:
    """One line for an error of a save or load. DCP's CheckpointException prints every rank's
    whole traceback, with the cause last, past any sensible cut: name each failed rank's own
    exception instead, ranks with the same one together."""
    failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
    if not failures:
        return f"{type(e).__name__}: {e}"[:limit]
    causes = {}
    for rank, pair in sorted(failures.items()):
        exc = pair[0] if isinstance(pair, tuple) else pair
        causes.setdefault(f"{type(exc).__name__}: {exc}".strip(), []).append(rank)
    text = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {c}" for c, r in causes.items())
    return text[:limit]


def _is_peer_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return any(s in text for s in PEER_LOST)
