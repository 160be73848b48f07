"""The save side of checkpoint shards through torch.distributed.checkpoint: the collective save
(staged on local disk and uploaded, for remote storage) with the digest of each file and of each
item in it, and the in-memory snapshot a persist writes. The load side (verification, the checked
load) is loading.py's.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.tensor import DTensor

from elastic.checkpoint import uploader
from elastic.checkpoint.layout import local_file_digest, local_item_digests
from elastic.checkpoint.staging import stage_folder
from elastic.storage import StorageError, StorageTimeout
from elastic.checkpoint.uploader import UploadCut

DCP_METADATA = ".metadata"  # DCP's index of a save, written last by its coordinator

# Remote uploads run in a child process (checkpoint/uploader.py), not beside training's thread in
# the worker's: False uploads in the worker (for an A/B of the two). Process-private filesystems
# (`_process_private`: memory://) always upload in the worker, the only process that sees them.
UPLOAD_IN_CHILD = True


@dataclass(frozen=True)
class UploadBound:
    """How long one rank's upload of a save may take before it counts as hung:
    checkpoint.upload_timeout_s, plus its bytes at checkpoint.upload_min_mb_per_s (a 1.2 GB
    shard at the defaults: 60 + 600 s). Past it the upload is cut short with `StorageTimeout`."""
    floor_s: float
    min_mb_per_s: float

    def seconds(self, num_bytes: int) -> float:
        return self.floor_s + num_bytes / (self.min_mb_per_s * 1e6)

    def describe(self, num_bytes: int) -> str:
        return (f"checkpoint.upload_timeout_s={self.floor_s:g} + {num_bytes / 1e6:.1f} MB at "
                f"checkpoint.upload_min_mb_per_s={self.min_mb_per_s:g}")


@dataclass(frozen=True)
class SavedShards:
    """What a collective save wrote: DCP's index (`metadata`), the digest of every file any rank
    wrote (name -> "crc32:...") and of every item in it (name -> {item_key: "crc32:..."}), the
    same on every rank."""
    metadata: Any
    digests: dict[str, str] = field(default_factory=dict)
    item_digests: dict[str, dict[str, str]] = field(default_factory=dict)


def save_shards(state: dict, folder: str, storage_options: dict, process_group,
                on_write: Callable[[], None] | None = None, cancel: threading.Event | None = None,
                on_cuttable: Callable[[], None] | None = None,
                fence: tuple[str, int] | None = None, upload_bound: UploadBound | None = None) -> SavedShards:
    """Collective DCP save into `folder`; returns DCP's index of what it wrote and every file's
    digest (`SavedShards`). Each rank digests the files it wrote from its local copy, right after
    DCP wrote them (page cache, not a second read from storage), and the ranks gather them.
    `on_write` is called when this rank starts writing to `folder` itself (after the collective
    planning; for a remote folder, when the upload of the staged files begins). `cancel` set
    during the upload cuts it short (`UploadCut`; see `upload`); `on_cuttable` is called when an
    upload that can be cut begins. `fence` (the fence's URI, this group's generation): a remote
    upload reads it before each object it writes and stops at a "no" (`uploader.put_tree`:
    `UploadFenced`, `FenceNotConfirmed`), raised on this rank; the caller makes it collective.
    `upload_bound`: a remote upload still running past it (for this rank's staged bytes) is cut
    short with `StorageTimeout`, a storage error like any other (None: no bound).
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
    Every rank learns whether every upload and digest succeeded (one gather, which also carries
    the digests), so all of them raise or none does and the caller's retries stay in lockstep.
    The staged files are digested in a thread while they upload (zlib drops the GIL): at 102.7 M
    parameters and AdamW that hides 0.3 s of summing 1.23 GB behind the upload (local_file_digest;
    on file:// the same 0.3 s follows DCP's write, ~1.3 s, in the persist's thread)."""
    if folder.startswith("file://"):
        # Never pass checkpoint_id= as well: DCP would rebuild the filesystem from it without
        # the storage options.
        writer = _RecordingWriter(on_write, folder, sync_files=True, **storage_options)
        metadata = dcp.save(state, storage_writer=writer, process_group=process_group)
        error, digests = None, ({}, {})
        try:
            local = fsspec.core.url_to_fs(folder, **storage_options)[1]
            digests = _digest_local(local, writer.written, metadata)
        except Exception as e:  # noqa: BLE001 - made collective below, then raised on every rank
            error = e
        return SavedShards(metadata, *_agree_on_digests(error, digests, folder, process_group,
                                                         "digest"))
    with stage_folder() as stage, concurrent.futures.ThreadPoolExecutor(1, "digest") as pool:
        # No fsync: the staged copy is only read back by the upload and the digests, never after
        # a crash.
        metadata = dcp.save(state, storage_writer=FileSystemWriter(stage, sync_files=False),
                            process_group=process_group)
        # Every file in the stage is this rank's (and DCP's index, on its coordinator).
        digesting = pool.submit(_digest_local, stage, sorted(os.listdir(stage)), metadata)
        error = None
        try:
            if on_write:
                on_write()
            fs, path = fsspec.core.url_to_fs(folder, **storage_options)
            in_child = UPLOAD_IN_CHILD and not _process_private(fs)
            timeout_s, bound = None, ""
            if upload_bound is not None:
                num_bytes = sum(os.path.getsize(os.path.join(stage, n)) for n in os.listdir(stage))
                timeout_s, bound = upload_bound.seconds(num_bytes), upload_bound.describe(num_bytes)
            if not (in_child and uploader.put(stage, folder, storage_options, cancel, on_cuttable=on_cuttable,
                                              fence=fence, timeout_s=timeout_s, bound=bound)):
                # No child idle (this worker's first upload, or its child busy): in this process,
                # then a child is started for the next upload.
                upload(fs, stage.rstrip("/") + "/", path.rstrip("/") + "/", cancel, on_cuttable=on_cuttable,
                       fence=fence, timeout_s=timeout_s, bound=bound)
                if in_child:
                    uploader.prestart(folder, storage_options)
        except UploadCut:
            raise  # the group is gone: nothing collective follows (the pool waits for the digests)
        except Exception as e:  # noqa: BLE001 - made collective below, then raised on every rank
            error = e
        digests = ({}, {})
        try:
            digests = digesting.result()
        except Exception as e:  # noqa: BLE001 - as an upload's error
            error = error or e
        return SavedShards(metadata, *_agree_on_digests(error, digests, folder, process_group,
                                                         "upload"))


Digests = tuple[dict[str, str], dict[str, dict[str, str]]]  # of files, of the items in each


def _digest_local(path: str, names, metadata) -> Digests:
    """The digest of each of `names` in the local folder `path`, and of each item DCP's index
    (`metadata`) places in it."""
    items: dict[str, list[tuple[int, int]]] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        items.setdefault(info.relative_path, []).append((info.offset, info.length))
    return ({name: local_file_digest(os.path.join(path, name)) for name in names},
            {name: local_item_digests(os.path.join(path, name), items[name])
             for name in names if name in items})


def _agree_on_digests(error: BaseException | None, digests: Digests, folder: str, process_group,
                      what: str) -> Digests:
    """Every rank's digests, on every rank; raises on every rank if any rank failed (its own
    error where it failed, a StorageError naming the step's folder on the others)."""
    if not (dist.is_available() and dist.is_initialized()):  # a single process, as DCP allows
        if error is not None:
            raise error
        return dict(digests[0]), dict(digests[1])
    gathered: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, (error is not None, digests), group=process_group)
    if error is not None:
        raise error
    if any(failed for failed, _ in gathered):
        raise StorageError(f"another rank's {what} of its shards of {folder} failed; retrying together")
    files: dict[str, str] = {}
    items: dict[str, dict[str, str]] = {}
    for _, (of_files, of_items) in gathered:
        files.update(of_files)
        items.update(of_items)
    return files, items


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
           on_cuttable: Callable[[], None] | None = None, fence: tuple[str, int] | None = None,
           timeout_s: float | None = None, bound: str = "") -> None:
    """In this process (`uploader.put` is the child's): `fs.put(src, dst, recursive=True)`, cut
    short within `poll_s` once `cancel` is set, on an async filesystem (s3fs, gcsfs, adlfs): its
    coroutine is cancelled on fsspec's event loop, which drops the connection mid-request
    (`on_cuttable` is called as such an upload begins). A synchronous filesystem uploads to the end.
    A multipart upload cut short stays incomplete in the bucket, invisible to readers, until
    the store's lifecycle rule for incomplete uploads removes it. `fence` (its URI, this group's
    generation): read before each object, as the child does (`uploader.put_tree`). `timeout_s`:
    an async upload still running then is cut short the same way, with `StorageTimeout` naming
    the bound (`bound`: where it comes from); a synchronous one cannot be cut (the persist's own
    bound, checkpoint.persist_timeout_s, then gives the persist up without it)."""
    if (cancel is None and timeout_s is None) or not getattr(fs, "async_impl", False):
        uploader.put_tree(fs, src, dst, fence)
        return
    if cancel is not None and cancel.is_set():
        raise UploadCut(f"upload of {dst} not begun")
    future = asyncio.run_coroutine_threadsafe(uploader.put_tree_async(fs, src, dst, fence), fs.loop)
    if on_cuttable:
        on_cuttable()
    t0 = time.monotonic()
    while True:
        try:
            future.result(timeout=poll_s)
            return
        except concurrent.futures.TimeoutError:
            if cancel is not None and cancel.is_set():
                future.cancel()
                raise UploadCut(f"upload of {dst} cut short") from None
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                future.cancel()
                raise StorageTimeout(f"upload of {dst} did not finish within {timeout_s:.1f} s"
                                     f"{f' ({bound})' if bound else ''}: cut short") from None


class _RecordingWriter(FsspecWriter):
    """DCP's fsspec writer that says when it starts writing this rank's files (`on_write`) and
    records the names of the files this rank wrote (`written`: its shards, and DCP's index on
    the coordinator)."""

    def __init__(self, on_write: Callable[[], None] | None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_write = on_write
        self.written: list[str] = []

    def write_data(self, plan, planner):
        if self.on_write:
            self.on_write()
        future = super().write_data(plan, planner)
        future.wait()
        self.written.extend(sorted({r.storage_data.relative_path for r in future.value()}))
        return future

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.written.append(DCP_METADATA)


def snapshot(state: Any, reuse: Any = None) -> Any:
    """A private CPU copy of a (nested) state dict, so training can go on while it persists.
    `reuse`: the previous snapshot (its persist finished): tensors, and the local shards of CPU
    DTensors, of the same shape and dtype are copied into in place, so staging does not
    allocate (and fault in) fresh memory at every checkpoint; GPU state is staged in pinned
    memory."""
    if isinstance(state, torch.Tensor):
        src = state.detach()
        if type(src) is torch.Tensor:
            if (type(reuse) is torch.Tensor and reuse.shape == src.shape and reuse.dtype == src.dtype
                    and reuse.device.type == "cpu"):
                return reuse.copy_(src)
            if src.is_cuda:
                return torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
        elif _cpu_shard(src):
            # A shard (FSDP) into the last snapshot's shard: a fresh copy each time held two
            # snapshots at once while the new one was made (0.75 x state/N more at the peak).
            return _into_shard(src, reuse)
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
    shared core it stopped the checkpoint's step for seconds. DTensors (FSDP's shards) and
    everything else get None: made ahead, a shard's buffers held 0.75 x state/N from the start,
    long before the first checkpoint (a 1.5 GB model over 4 ranks capped at 1,400 MiB each ran
    out of memory at step 2); its first snapshot makes them, and the next ones reuse them."""
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


def _cpu_shard(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and t.device_mesh.device_type == "cpu"


def _into_shard(src: DTensor, reuse: Any) -> DTensor:
    """A CPU DTensor like `src` (its mesh, placements, global shape) whose local shard is
    `reuse`'s local memory where shape and dtype match, else fresh; filled with `src`'s values."""
    local = src.to_local()
    buf = reuse.to_local() if isinstance(reuse, DTensor) else None
    fits = buf is not None and buf.shape == local.shape and buf.dtype == local.dtype
    if not fits or buf.device.type != "cpu":
        buf = torch.empty(local.shape, dtype=local.dtype)
    buf.copy_(local)
    return DTensor.from_local(buf, src.device_mesh, src.placements, run_check=False,
                              shape=src.shape, stride=src.stride())


def written_files(metadata) -> set[str] | None:
    """The files a DCP save wrote, from the index it returned: shards named in `storage_data`
    plus the index itself. None when the index does not say."""
    storage_data = getattr(metadata, "storage_data", None)
    if storage_data is None:
        return None
    return {info.relative_path for info in storage_data.values()} | {DCP_METADATA}
