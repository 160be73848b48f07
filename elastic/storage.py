"""The storage seam: fsspec URIs as plain strings (file://, s3://, memory://).

Paths stay `str` because pathlib mangles `s3://bucket/key`. Every error names
the URI that failed. Small files are written whole (one PUT on object stores;
temp file + rename on local disk) so a reader never sees half a file. Only
local disk can append (`can_append`); object stores write whole objects. An error names the URI
but never a credential: the options' secrets and a URI's password are scrubbed from its message
(elastic/config/secrets.py).
"""
from __future__ import annotations

import os
import threading
import uuid
from typing import Any, Callable, Hashable, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic.config.secrets import scrub, secret_values


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI."""


class StorageTimeout(StorageError):
    """A storage call or upload did not end within its bound (a hung request, not a refused one);
    the message names the URI and the bound, with the settings it comes from. Handled as any
    storage failure: retried, then reported."""


def scrubbed_error(message: str, cause: BaseException | None, secrets: frozenset[str]) -> StorageError:
    """A StorageError for `message` with the credentials in `secrets` (and a URI's password)
    scrubbed. Its __cause__ (which a traceback prints, and callers test: fencing's "no such file")
    is `cause`, or where that quotes a credential, an error of the same type with the message
    scrubbed. Raise the result without `from`."""
    err = StorageError(scrub(message, secrets))
    if cause is not None and scrub(str(cause), secrets) != str(cause):
        try:
            cause = type(cause)(scrub(str(cause), secrets))
        except Exception:  # noqa: BLE001 - a type that takes other arguments: no cause rather than a leak
            cause = None
    err.__cause__ = cause
    err.__suppress_context__ = True
    return err


T = TypeVar("T")

# Calls of one purpose that may still hang after their callers stopped waiting. One more call
# into a mount that hangs only adds a thread that hangs too (the lease renewal asked one every
# ttl_s / 4, each left behind for good); two leave room for one stuck connection beside a
# store that answers again.
HUNG_PER_PURPOSE = 2
_hung: dict[Hashable, int] = {}
_hung_lock = threading.Lock()


def call_within(fn: Callable[[], T], timeout_s: float, purpose: Hashable | None = None
                ) -> tuple[bool, T | None, BaseException | None]:
    """(answered, result, error) of `fn()`, waiting at most `timeout_s`: for a storage call that
    must not hold up a decision while storage hangs (an outage). An unanswered call goes on in a
    daemon thread and its result is dropped. While HUNG_PER_PURPOSE calls of the same `purpose`
    still hang, the next is not answered at once, with no thread started. `purpose` defaults
    to the call site: `fn`'s code, and for a bound method its instance."""
    key = purpose if purpose is not None else _purpose_of(fn)
    with _hung_lock:
        if _hung.get(key, 0) >= HUNG_PER_PURPOSE:
            return False, None, None
    out: dict[str, Any] = {}
    done = threading.Event()
    given_up = [False]

    def call() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e
        with _hung_lock:
            done.set()
            if given_up[0]:
                _release_hung(key)

    threading.Thread(target=call, name="storage-call", daemon=True).start()
    if not done.wait(timeout_s):
        with _hung_lock:
            if not done.is_set():  # (it may have ended since)
                given_up[0] = True
                _hung[key] = _hung.get(key, 0) + 1
                return False, None, None
    return True, out.get("result"), out.get("error")


def hung_calls(purpose: Hashable) -> int:
    """How many calls of `purpose` (as call_within keys it) still hang after their callers gave up."""
    with _hung_lock:
        return _hung.get(purpose, 0)


def _release_hung(key: Hashable) -> None:
    left = _hung.get(key, 0) - 1
    if left > 0:
        _hung[key] = left
    else:
        _hung.pop(key, None)


def _purpose_of(fn: Callable) -> Hashable:
    """The call site (`fn`'s code) and what it calls on: a bound method's instance, a closure's
    captured objects (a lambda over `ctl` is one purpose per controller). One run's hung calls
    must not refuse another run's in the same process (a notebook, a test session) a store.
    Identities stay unique while the key is held: the hung call keeps these objects alive."""
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    captured = []
    for cell in getattr(func, "__closure__", None) or ():
        try:
            captured.append(id(cell.cell_contents))
        except ValueError:  # a cell not yet filled
            captured.append(None)
    return (code if code is not None else type(fn), id(owner) if owner is not None else None, tuple(captured))


def normalize_uri(uri: str) -> str:
    """Make `file://./runs` or a bare path absolute, so every node agrees on it."""
    if "://" not in uri:
        return "file://" + os.path.abspath(os.path.expanduser(uri))
    if uri.startswith("file://"):
        return "file://" + os.path.abspath(os.path.expanduser(uri[len("file://"):]))
    return uri.rstrip("/")


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


class Storage:
    def __init__(self, uri: str, options: dict[str, Any] | None = None):
        self.uri = normalize_uri(uri)
        self.options = dict(options or {})
        self._secrets = secret_values(self.options, self.uri)
        try:
            self.fs, self._root = fsspec.core.url_to_fs(self.uri, **self.options)
        except Exception as e:  # noqa: BLE001
            raise self.error(f"cannot open storage {self.uri}: {type(e).__name__}: {e}", e)

    def __repr__(self) -> str:
        return f"Storage({scrub(self.uri, self._secrets)!r})"

    def error(self, message: str, cause: BaseException | None = None) -> StorageError:
        """A StorageError whose message shows none of this storage's credentials (`scrubbed_error`)."""
        return scrubbed_error(message, cause, self._secrets)

    def _path(self, uri: str) -> str:
        # Strip our own scheme; fsspec filesystems take scheme-less paths.
        return self.fs._strip_protocol(uri)

    def _fail(self, op: str, uri: str, e: BaseException) -> StorageError:
        return self.error(f"{op} {uri} failed: {type(e).__name__}: {e}", e)

    def exists(self, uri: str) -> bool:
        try:
            return self.fs.exists(self._path(uri))
        except Exception as e:  # noqa: BLE001
            raise self._fail("exists", uri, e)

    def _durable_temp(self, path: str, data: bytes) -> str:
        """`data` in a new temporary file beside local `path`, on disk (fsync): renamed or linked
        into place by the caller, so a reader never sees a half-written file."""
        self.fs.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def write_bytes(self, uri: str, data: bytes) -> None:
        path = self._path(uri)
        try:
            if isinstance(self.fs, LocalFileSystem):
                os.replace(self._durable_temp(path, data), path)
            else:
                self.fs.pipe_file(path, data)
        except Exception as e:  # noqa: BLE001
            raise self._fail("write", uri, e)

    def create(self, uri: str, data: bytes) -> bool:
        """Write `uri` only if nothing is there: True if this call created it, False if it existed.
        Exclusive where the store can say so: local disk (a hard link, which fails on an existing
        name, of a fully written temporary file), memory, and S3 with
        conditional writes (`If-None-Match: *`, through s3fs's "xb" mode). A store that ignores the
        condition overwrites: callers that need to know read the object back (see lease.py)."""
        path = self._path(uri)
        try:
            if isinstance(self.fs, LocalFileSystem):
                tmp = self._durable_temp(path, data)
                try:
                    os.link(tmp, path)  # fails if `path` exists; a reader never sees it half written
                finally:
                    os.unlink(tmp)
                return True
            with self.fs.open(path, "xb") as f:
                f.write(data)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            # S3's answer to If-None-Match on an existing key is 412 Precondition Failed, which s3fs
            # raises as a plain OSError (seen with SeaweedFS, which honours the condition).
            if "pre-condition" in str(e).lower() or "precondition" in str(e).lower():
                return False
            raise self._fail("create", uri, e)
        except Exception as e:  # noqa: BLE001
            raise self._fail("create", uri, e)

    @property
    def can_append(self) -> bool:
        """Local disk appends in place; object stores (s3, memory) can only write whole objects."""
        return isinstance(self.fs, LocalFileSystem)

    def append_bytes(self, uri: str, data: bytes) -> None:
        """Append to a file on local disk, durably (fsync before returning). All or nothing: after a
        failed append the file is cut back to its old length, so a retry neither repeats nor tears."""
        if not self.can_append:
            raise self.error(f"append {uri} failed: {self.uri} is an object store, which cannot append")
        path = self._path(uri)
        try:
            self.fs.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = os.fstat(fd).st_size
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                except BaseException:
                    os.ftruncate(fd, start)
                    raise
            finally:
                os.close(fd)
        except Exception as e:  # noqa: BLE001
            raise self._fail("append", uri, e)

    def read_tail(self, uri: str, num_bytes: int) -> bytes:
        """The last `num_bytes` of a file (fewer if it is shorter)."""
        try:
            return self.fs.tail(self._path(uri), num_bytes)
        except Exception as e:  # noqa: BLE001
            raise self._fail("read", uri, e)

    def read_bytes(self, uri: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(uri))
        except Exception as e:  # noqa: BLE001
            raise self._fail("read", uri, e)

    def list_dir(self, uri: str) -> list[str]:
        """Names (not paths) directly under `uri`; empty if it does not exist."""
        path = self._path(uri)
        try:
            self.fs.invalidate_cache(path)
            if not self.fs.exists(path):
                return []
            return sorted(os.path.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False))
        except Exception as e:  # noqa: BLE001
            raise self._fail("list", uri, e)

    def sizes(self, uri: str) -> dict[str, int]:
        """name -> size of the files directly under `uri`."""
        path = self._path(uri)
        try:
            self.fs.invalidate_cache(path)
            return {os.path.basename(d["name"].rstrip("/")): int(d.get("size") or 0)
                    for d in self.fs.ls(path, detail=True) if d.get("type") != "directory"}
        except Exception as e:  # noqa: BLE001
            raise self._fail("list", uri, e)

    def remove_tree(self, uri: str) -> None:
        try:
            self.fs.rm(self._path(uri), recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise self._fail("remove", uri, e)

    def remove(self, uri: str) -> None:
        """Remove one file."""
        try:
            self.fs.rm_file(self._path(uri))
        except Exception as e:  # noqa: BLE001 - fsspec backends raise their own types
            raise self._fail("remove", uri, e)

    def check_writable(self, uri: str) -> None:
        """Fail fast at start, naming the URI, if we cannot write and delete there."""
        probe = join(uri, f".elastic-probe-{uuid.uuid4().hex}")
        try:
            self.write_bytes(probe, b"ok")
            if self.read_bytes(probe) != b"ok":
                raise self.error(f"storage {uri}: read back of a probe file returned other bytes")
            self.fs.rm(self._path(probe))
        except StorageError as e:
            raise self.error(f"storage {uri} is not writable: {e}", e)
        except Exception as e:  # noqa: BLE001
            raise self.error(f"storage {uri} is not writable: {type(e).__name__}: {e}", e)
