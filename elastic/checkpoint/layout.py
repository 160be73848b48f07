"""Checkpoint folders: their layout, the commit protocol, what a listing accepts, and what this
process knows of their contents (`Verdicts`). Retention is retention.py's.

Layout, under `<storage_uri>/<run name>/checkpoints/`:

    step_000000040/            one folder per checkpoint, never overwritten
        __0_0.distcp ...       shards, written by torch.distributed.checkpoint
        .metadata              DCP's index, written by its coordinator
        manifest.json          step, data cursor and what the sample order depends on, world size,
                               every file this save wrote, its size and its content digest (crc32)
        COMMITTED              written last, by rank 0, after all of the above are durable

A folder without COMMITTED, or whose files do not match its manifest's sizes, does not
exist as far as any reader is concerned (invariant 3). Nor does one whose manifest does not parse
strictly (a field missing or of another type) or whose step differs between its name, its
manifest and COMMITTED: a listing skips it, says why (`on_skip`), and goes on to the next older
folder, so one bad folder never hides the others. Sizes are checked on every listing;
contents (the digests) by a restore before it loads (`loading.verify_shards`), which skips a
folder whose bytes changed after the commit (bit rot, a same-size overwrite) and falls back to
the next.

A committed folder is never written again: a step redone after a recovery finds
its folder committed and reports that commit instead of saving (the redone state
equals the saved one, invariant 1). An uncommitted folder of that step is left
over from a lost attempt: it is removed before the save, and the manifest lists
only the files this save's DCP metadata names, so a stray file can never become
part of a checkpoint.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import threading
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic.checkpoint.manifest import Manifest, item_key
from elastic.storage import Storage, StorageError, join

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
_PREFIX = "step_"
NO_MARKER = "no commit marker (persist did not finish)"  # why a listing skips a folder in flight
DIGEST = "crc32"  # zlib's: 3.7 GB/s on one core here, and it releases the GIL (see file_digest)
_CHUNK = 16 << 20  # bytes read at a time while digesting a file


def checkpoints_root(storage_uri: str, run_name: str) -> str:
    return join(storage_uri, run_name, "checkpoints")


def step_dir(root: str, step: int) -> str:
    return join(root, f"{_PREFIX}{step:09d}")


def step_of_uri(uri: str | None) -> int | None:
    """The step of a checkpoint folder's URI (None: not one)."""
    return _step_of(uri.rstrip("/").rsplit("/", 1)[-1]) if uri else None


def _step_of(name: str) -> int | None:
    if not name.startswith(_PREFIX):
        return None
    try:
        return int(name[len(_PREFIX):])
    except ValueError:
        return None


class CorruptCheckpoint(ValueError):
    """A committed checkpoint's file does not hold the bytes its manifest's digest says."""


def file_digest(f: BinaryIO, chunk: int = _CHUNK) -> str:
    """The digest of what is left to read in `f` ("crc32:xxxxxxxx"). zlib drops the GIL while it
    sums a chunk, so a digest beside training costs a core, not the training thread's turn."""
    crc = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    readinto = getattr(f, "readinto", None)
    while True:
        if readinto is not None:
            n = readinto(buf)
            data = view[:n] if n else b""
        else:  # some fsspec files only read
            data = f.read(chunk)
            n = len(data)
        if not n:
            return f"{DIGEST}:{crc:08x}"
        crc = zlib.crc32(data, crc)


def local_file_digest(path: str) -> str:
    """`file_digest` of a file on local disk, summed straight from the page cache (mmap): a GiB in
    0.4-0.65 s here, against 0.7-1.1 s copied out in chunks first."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return f"{DIGEST}:{0:08x}"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return f"{DIGEST}:{zlib.crc32(m):08x}"


def local_item_digests(path: str, items) -> dict[str, str]:
    """`item_key` -> digest of each (offset, length) of `items` in a file on local disk (mmap)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return {item_key(o, n): f"{DIGEST}:{0:08x}" for o, n in items}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                return {item_key(o, n): f"{DIGEST}:{zlib.crc32(view[o:o + n]):08x}"
                        for o, n in items}
            finally:
                view.release()  # the mmap cannot close while a view of it lives


def check_files(folder: str, storage_options: dict, manifest: Manifest, names) -> str | None:
    """Read `names` (files of the committed checkpoint in `folder`) and compare each with its
    digest in `manifest`. None when all match (a file without a digest, or with a digest kind this
    version does not know, is not checked); else the first mismatch, naming the file. Storage
    errors raise StorageError (unreadable is not corrupt: the caller decides)."""
    fs, path = fsspec.core.url_to_fs(folder, **storage_options)
    step_folder = folder.rstrip("/").rsplit("/", 1)[-1]
    for name in names:
        want = manifest.digests.get(name)
        if want is None or not want.startswith(DIGEST + ":"):
            continue
        full = f"{path.rstrip('/')}/{name}"
        try:
            if isinstance(fs, LocalFileSystem):
                got = local_file_digest(full)
            else:
                with fs.open(full, "rb") as f:
                    got = file_digest(f)
        except Exception as e:  # noqa: BLE001 - fsspec backends raise their own types
            raise StorageError(f"read {folder}/{name} failed: {type(e).__name__}: {e}") from e
        if got != want:
            return f"digest mismatch in {step_folder}/{name}: {got}, the manifest says {want}"
    return None


class Verdicts:
    """What this process knows about committed checkpoints' contents, keyed by folder and manifest
    (a folder committed again under another manifest is judged afresh): whether they verify (their
    files match their manifest's digests), why not, and whether that was *read back*: every file
    read from storage (a restore's verification, across its group; retention's read). A commit
    notes its own folder as verified but not read back: its digests come from the local copies it
    uploaded, and what storage holds was never read. Retention reads a folder when nothing is known
    of it, and reads one back before it removes the last one read back (elastic/checkpoint/
    retention.py)."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, bytes], tuple[str | None, bool]] = {}  # (problem, read back)
        self._lock = threading.Lock()

    def note(self, folder: str, manifest: Manifest, problem: str | None,
             read_back: bool = True) -> None:
        """`problem`: None for verified, else why the folder does not load. `read_back`: the
        verdict comes from reading storage (a problem always counts as one)."""
        with self._lock:
            key = (folder.rstrip("/"), manifest.to_json())
            if problem is None and not read_back and self._known.get(key) == (None, True):
                return  # read back already: a commit's own word adds nothing
            self._known[key] = (problem, read_back or problem is not None)

    def known(self, folder: str, manifest: Manifest) -> tuple[bool, str | None]:
        """(whether anything is known, the problem if it failed)."""
        with self._lock:
            found = self._known.get((folder.rstrip("/"), manifest.to_json()))
            return found is not None, found[0] if found else None

    def read_back(self, folder: str, manifest: Manifest) -> bool:
        """Whether every file of the folder was read from storage and matched its digest."""
        with self._lock:
            return self._known.get((folder.rstrip("/"), manifest.to_json())) == (None, True)

    def problem(self, storage: Storage, c: "CommittedCheckpoint",
                read_back: bool = False) -> str | None:
        """Why `c` does not verify, or None: as known, else read (every file, by this process).
        `read_back`: read unless it was read back already (a commit's own word is not enough)."""
        found, problem = self.known(c.uri, c.manifest)
        if found and (problem is not None or not read_back or self.read_back(c.uri, c.manifest)):
            return problem
        problem = check_files(c.uri, storage.options, c.manifest, sorted(c.manifest.digests))
        self.note(c.uri, c.manifest, problem)
        return problem


VERDICTS = Verdicts()  # this process's


@dataclass(frozen=True)
class CommittedCheckpoint:
    uri: str
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


def commit(storage: Storage, folder: str, manifest: Manifest) -> None:
    """Manifest, then the marker: the marker's presence means everything else is durable. The
    digests were taken from the bytes written: this process counts the folder as verified, not
    as read back (what storage holds was never read)."""
    storage.write_bytes(join(folder, MANIFEST), manifest.to_json())
    storage.write_bytes(join(folder, COMMIT_MARKER), str(manifest.step).encode())
    VERDICTS.note(folder, manifest, None, read_back=False)


def validate(storage: Storage, folder: str) -> Manifest:
    """The folder's manifest if the folder is committed and intact: its manifest parses, lists
    files that are there at their sizes, and its step is the one in the folder's name and in
    COMMITTED. ValueError saying why not; StorageError when storage does not answer (a file that
    is not there is an answer: ValueError)."""
    names = _answer(storage.sizes, folder, "the folder")
    if COMMIT_MARKER not in names:
        raise ValueError(NO_MARKER)
    manifest = manifest_of(_answer(storage.read_bytes, join(folder, MANIFEST), MANIFEST), folder)
    for name, size in manifest.files.items():
        if name not in names:
            raise ValueError(f"file {name} listed in the manifest is missing")
        if names[name] != size:
            raise ValueError(f"file {name} has {names[name]} bytes, manifest says {size}")
    marker = _answer(storage.read_bytes, join(folder, COMMIT_MARKER), COMMIT_MARKER).strip()
    if not re.fullmatch(rb"[0-9]+", marker):
        raise ValueError(f"{COMMIT_MARKER} holds {marker[:40]!r}, not a step")
    if int(marker) != manifest.step:
        raise ValueError(f"{COMMIT_MARKER} says step {int(marker)}, the manifest step "
                         f"{manifest.step}")
    return manifest


def manifest_of(data: bytes, folder: str) -> Manifest:
    """The manifest `data` read from `folder`: parsed strictly, its step the one in the folder's
    name (ValueError saying why not)."""
    manifest = Manifest.from_json(data)
    named = step_of_uri(folder)
    if named is not None and manifest.step != named:
        raise ValueError(f"the manifest says step {manifest.step}, the folder's name step {named}")
    return manifest


def _answer(call: Callable[[str], Any], uri: str, what: str) -> Any:
    """`call(uri)`; a file or folder that is not there raises ValueError (a verdict on the folder:
    a listing skips it), any other storage error StorageError (no verdict: the caller waits)."""
    try:
        return call(uri)
    except StorageError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            raise ValueError(f"{what} is not there (removed while listing?)") from e
        raise


def committed_checkpoints(
    storage: Storage, root: str, on_skip: Callable[[str, str], None] | None = None
) -> list[CommittedCheckpoint]:
    """Committed, intact checkpoints, newest first. `on_skip(uri, reason)` hears about the rest
    (without it, a folder that holds a commit marker and is skipped is logged). Whatever is wrong
    with one folder (see `validate`; any exception) skips that folder alone; StorageError, storage
    not answering, is raised: it says nothing about any folder."""
    return list(_committed(storage, root, on_skip))


def _committed(storage: Storage, root: str, on_skip) -> Iterator[CommittedCheckpoint]:
    names = [(s, n) for n in storage.list_dir(root) if (s := _step_of(n)) is not None]
    for _, name in sorted(names, reverse=True):  # by step: a name's digits may outgrow its padding
        folder = join(root, name)
        try:
            yield CommittedCheckpoint(folder, validate(storage, folder))
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - one bad folder must not hide the older ones
            why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            if on_skip:
                on_skip(folder, why)
            elif why != NO_MARKER:
                log.warning("checkpoint %s skipped: %s", folder, why)


def latest_committed(storage: Storage, root: str, on_skip=None) -> CommittedCheckpoint | None:
    """The newest of `committed_checkpoints` (the older folders are not read)."""
    return next(_committed(storage, root, on_skip), None)


def abandon_after(storage: Storage, root: str, step: int) -> list[str]:
    """Un-commit the checkpoints after `step` (a rollback abandons their timeline): their commit
    markers go, so they are never restored and a redone step writes its own. Returns them."""
    out = []
    for c in committed_checkpoints(storage, root):
        if c.step > step:
            storage.remove(join(c.uri, COMMIT_MARKER))
            out.append(c.uri)
    return out
