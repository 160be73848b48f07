"""The load side of checkpoint shards: the collective verification of a committed checkpoint's
files against its manifest before a load (`verify_shards`, each file read once across the group),
and DCP's load, which checks every byte it hands DCP against the same manifest as it reads it
(`load_shards`). The save side is dcp_io.py's.
"""
from __future__ import annotations

import io
import os
import zlib
from contextlib import contextmanager

import fsspec
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader

from elastic.checkpoint.dcp_io import DCP_METADATA
from elastic.checkpoint.layout import (DIGEST, MANIFEST, VERDICTS, CorruptCheckpoint, Manifest,
                                       check_files, manifest_of)
from elastic.checkpoint.manifest import item_key
from elastic.storage import StorageError


def verify_shards(folder: str, storage_options: dict, process_group) -> Manifest:
    """Check the committed checkpoint in `folder` against its manifest's digests before a load,
    collectively: each rank of `process_group` reads a share of the files (split by size), so
    every file is read once across the group, and the ranks agree on one verdict (a gather), so
    that every rank raises or none does and all move to the same next candidate. Raises
    CorruptCheckpoint naming the file whose bytes differ, or StorageError when a rank could not
    read (the manifest or a file). Files without a digest (a manifest written before digests
    were recorded) are not checked. The verdict is noted in this process's `VERDICTS`, which
    retention consults. Returns the manifest."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    else:
        rank, world = 0, 1
    manifest, corrupt, unreadable = None, None, None
    try:
        fs, path = fsspec.core.url_to_fs(folder, **storage_options)
        manifest = manifest_of(fs.cat_file(f"{path.rstrip('/')}/{MANIFEST}"), folder)
        corrupt = check_files(folder, storage_options, manifest, share_of(manifest, rank, world))
    except Exception as e:  # noqa: BLE001 - made collective below
        unreadable = f"cannot verify {folder}: {type(e).__name__}: {e}"
    verdicts = [(corrupt, unreadable)]
    if world > 1:
        verdicts = [None] * world
        dist.all_gather_object(verdicts, (corrupt, unreadable), group=process_group)
    corrupt = next((c for c, _ in verdicts if c), None)
    if corrupt is not None:
        if manifest is not None:
            VERDICTS.note(folder, manifest, corrupt)
        raise CorruptCheckpoint(corrupt)
    unreadable = next((u for _, u in verdicts if u), None)
    if unreadable is not None:
        raise StorageError(unreadable if verdicts[rank][1] else f"{unreadable} (on another rank)")
    VERDICTS.note(folder, manifest, None)
    return manifest


def share_of(manifest: Manifest, rank: int, world: int) -> list[str]:
    """The files with a digest that `rank` of `world` verifies: largest first, each to the rank
    with the fewest bytes so far (the same split on every rank, from the manifest alone)."""
    loads = [0] * world
    mine = []
    for name in sorted(manifest.digests, key=lambda n: (-manifest.files.get(n, 0), n)):
        r = loads.index(min(loads))
        loads[r] += manifest.files.get(name, 0)
        if r == rank:
            mine.append(name)
    return mine


def load_shards(state: dict, folder: str, storage_options: dict, process_group,
                manifest: Manifest | None = None) -> None:
    """Load in place into `state` (tensors are overwritten). With the folder's `manifest`, every
    byte DCP is handed is checked against its digests as it is read (`_VerifyingReader`): a file
    that changed after `verify_shards` read it fails the load (CorruptCheckpoint, on every rank
    through DCP) rather than load other bytes than were verified."""
    reader = (FsspecReader(folder, **storage_options) if manifest is None
              else _VerifyingReader(folder, manifest, **storage_options))
    dcp.load(state, storage_reader=reader, process_group=process_group)


class _VerifyingReader(FsspecReader):
    """DCP's fsspec reader, checking what it reads against the manifest: each item (a tensor's
    shard, a pickled object) against its own digest as it is read, and DCP's index against its
    file's. A file whose items have no digests of their own (a manifest from before they were
    recorded) is read whole, once, checked against its file's digest, and its items are served
    from those bytes. Either way what was checked is what loads."""

    def __init__(self, folder: str, manifest: Manifest, **storage_options):
        super().__init__(folder, **storage_options)
        self.folder, self.manifest = folder, manifest
        self._whole: tuple[str, bytes] | None = None  # the legacy file last read whole
        checked = _CheckedIndex(self)
        checked.fs = self.fs.fs
        self.fs = checked

    def _slice_file(self, file, sinfo):
        name = sinfo.relative_path
        items = self.manifest.item_digests.get(name)
        if items is not None:
            key = item_key(sinfo.offset, sinfo.length)
            if key not in items:  # DCP's index changed after the commit, or it is not the save's
                self.fail(f"{name} holds no item {key} (offset+length) that its save wrote")
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            self.check(f"{name} (item {key})", data, items[key])
            return io.BytesIO(data)
        if not _checked_kind(self.manifest.digests.get(name)):
            return super()._slice_file(file, sinfo)  # no digest (an old manifest): loaded unchecked
        if self._whole is None or self._whole[0] != name:
            file.seek(0)
            self._whole = (name, self.check(name, file.read(), self.manifest.digests[name]))
        return io.BytesIO(self._whole[1][sinfo.offset:sinfo.offset + sinfo.length])

    def check(self, what: str, data: bytes, want: str | None) -> bytes:
        """`data`, if it matches `want` (or `want` is no digest this version knows)."""
        if _checked_kind(want):
            got = f"{DIGEST}:{zlib.crc32(data):08x}"
            if got != want:
                step_folder = self.folder.rstrip("/").rsplit("/", 1)[-1]
                self.fail(f"digest mismatch in {step_folder}/{what} as loaded: {got}, the manifest "
                          f"says {want}")
        return data

    def fail(self, problem: str) -> None:
        VERDICTS.note(self.folder, self.manifest, problem)
        raise CorruptCheckpoint(problem)


def _checked_kind(digest: str | None) -> bool:
    return digest is not None and digest.startswith(DIGEST + ":")


class _CheckedIndex(FileSystem):
    """The reader's filesystem: DCP's index (its coordinator's `.metadata`, a pickle) is read
    whole and checked against its file's digest before DCP unpickles it."""

    def __init__(self, reader: _VerifyingReader):
        super().__init__()
        self.reader = reader

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "r" in mode and os.path.basename(os.fspath(path)) == DCP_METADATA:
                want = self.reader.manifest.digests.get(DCP_METADATA)
                yield io.BytesIO(self.reader.check(DCP_METADATA, stream.read(), want))
            else:
                yield stream
