"""Checkpoint uploads in a process of their own, beside the worker.

A remote checkpoint is staged by DCP on local disk, then uploaded with the filesystem's own
`put` (see `checkpoint.save_shards`). That upload runs beside training. In the worker's own
process, the upload's event loop (s3fs, aiobotocore) and the training thread take turns at the
GIL. Measured on 2 cores at 10.3 M parameters (120 MB to SeaweedFS on loopback, training on one
thread of the same process; benchmarks/probes/upload_process_probe.py, three runs of 10-20 shuffled
rounds): training ran 5-14 % more steps per second during a save with the upload in a child,
and the save took as long or up to 8 % longer. torch's DCP has a process-based async save for
the same reason. An idle child holds 60-90 MB.

One child serves one upload at a time and is kept for the next. A worker's first upload runs in
the worker itself, and the child is started once it has ended (`prestart`: a Python interpreter,
fsspec and the filesystem's package, about a second of CPU, in a thread of its own), so the
child's start competes with neither the first steps nor the first persist; an upload that finds
no child idle (still starting, or busy with an abandoned persist's upload) runs in the worker
too. Started with the rank's checkpointer (three children at once on a 2-core machine, with the
first steps) or at the first upload, the child delayed the first persist by seconds, in CI past
the 15 steps a chaos test allows it.
It exits when the worker does: on end of input, or within 0.5 s of its parent's death while
it uploads.

Fencing (fencing.py) holds inside an upload too: given the fence's URI and its generation, the
upload goes object by object and reads the fence before each one (and, on s3fs, again right
before it completes a multipart upload), and stops at the first read that does not show its own
generation: `UploadFenced` when the fence shows a newer one (the run moved on while this worker
was frozen or cut off mid-upload), `FenceNotConfirmed` when it cannot be read or shows anything
else (fail closed; the save is retried like any storage error). Without that, a worker that froze
mid-upload went on writing shards for the whole freeze once it thawed. The check costs one small
GET per object; a rank's save is one shard file (DCP's default) plus the index on the coordinator.

An upload has a deadline (`timeout_s`, from checkpoint.upload_timeout_s and the upload's bytes at
checkpoint.upload_min_mb_per_s): a store that takes the connection and never answers would
otherwise hold the persist, and every checkpoint after it, for good. Past it the child is killed
and the upload fails with `StorageTimeout`, retried and reported like any storage error.

Cutting an upload short (the group failed, see `AsyncCheckpointer.abort`) kills the child:
its connections drop mid-request, on any filesystem. A multipart upload cut short stays
incomplete in the bucket, invisible to readers, until the store's lifecycle rule removes it.

The child runs this file as a script and imports nothing of elastic (whose package imports
Ray and torch): only fsspec and the filesystem's own package.
"""
from __future__ import annotations

import contextvars
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting upload looks at its cancel flag
_HEADER = struct.Struct("<Q")


class UploadCut(Exception):
    """The upload was cut short on purpose: its group failed, so the persist could never commit."""


class UploadFailed(RuntimeError):
    """The child could not upload, and its error did not survive pickling: its type and message."""


class UploadFenced(RuntimeError):
    """The upload stopped before an object: the fence shows a newer generation than the upload's.
    That group may no longer write (fencing.py); nothing more of its upload lands."""


class FenceNotConfirmed(RuntimeError):
    """The upload stopped before an object: the fence could not be read, or showed a generation
    other than the upload's own. Nothing more lands; retried as a storage error is."""


# ---------------------------------------------------------------- the wire: length-prefixed pickles
def _send(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exactly(stream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            raise EOFError("the other end closed")
        buf += chunk
    return buf


def _recv(stream):
    (n,) = _HEADER.unpack(_read_exactly(stream, _HEADER.size))
    return pickle.loads(_read_exactly(stream, n))


# ---------------------------------------------------------------- the worker's side
class _Child:
    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the worker's packages (runtime_env)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


_idle: list[_Child] = []
_starting: list[threading.Thread] = []
_lock = threading.Lock()


def prestart(url: str, storage_options: dict) -> None:
    """Start a child for uploads to `url` ahead of the next one, in the background, with its
    filesystem built (its package imported). A no-op while one is idle or starting."""
    with _lock:
        if _idle or _starting:
            return
        starter = threading.Thread(target=_start, args=(url, storage_options), name="uploader-start", daemon=True)
        _starting.append(starter)
    starter.start()


def _start(url: str, storage_options: dict) -> None:
    child = None
    try:
        child = _Child()
        _send(child.proc.stdin, ("start", None, url, storage_options, None))
        answer = _recv(child.proc.stdout)
        if answer[0] != "ok":  # the upload itself will say what is wrong, with its own request
            log.debug("the uploader could not build the filesystem of %s: %s", url, answer[1:])
        _give_back(child)
    except Exception:  # noqa: BLE001 - best effort: the next upload runs in the worker and tries again
        log.debug("the uploader did not start", exc_info=True)
        if child is not None:
            child.kill()
    finally:
        with _lock:
            _starting.remove(threading.current_thread())


def _take_idle() -> _Child | None:
    with _lock:
        while _idle:
            child = _idle.pop()
            if child.alive():
                return child
    return None


def ready(timeout_s: float = 0.0) -> bool:
    """Whether a child is idle, after waiting at most `timeout_s` for one that is starting."""
    deadline = time.monotonic() + timeout_s
    with _lock:
        starting = list(_starting)
    for starter in starting:
        starter.join(max(0.0, deadline - time.monotonic()))
    with _lock:
        return any(child.alive() for child in _idle)


def _give_back(child: _Child) -> None:
    with _lock:
        if child.alive() and not _idle:
            _idle.append(child)
            return
    child.kill()


def put(src: str, url: str, storage_options: dict, cancel: threading.Event | None = None,
        on_cuttable=None, poll_s: float = POLL_S, fence: tuple[str, int] | None = None,
        timeout_s: float | None = None, bound: str = "") -> bool:
    """Upload the local folder `src` to `url` (an fsspec URL), as `fs.put(src, path,
    recursive=True)` would, in an idle child process; True once done. False, having done
    nothing, when no child is idle (none started yet, or the one there is busy): the caller
    uploads itself, then calls `prestart` for the next upload. Cut short within `poll_s` once
    `cancel` is set (`UploadCut`; `on_cuttable` is called as the upload begins). `fence`: (the
    fence's URI, this upload's generation): the child checks it before each object (`put_tree`)
    and stops with `UploadFenced` or `FenceNotConfirmed`, raised here. The child's other errors
    are raised here: the same exception where it pickles, else `UploadFailed` naming it.
    `timeout_s`: an upload not done by then hangs (a store that took the connection and never
    answers): its child is killed and `StorageTimeout` names `url` and the bound (`bound`: where
    it comes from). Without it, a hung upload was polled forever."""
    from elastic.storage import StorageError, StorageTimeout

    if cancel is not None and cancel.is_set():
        raise UploadCut(f"upload of {url} not begun")
    child = _take_idle()
    if child is None:
        return False
    try:
        _send(child.proc.stdin, ("put", src, url, storage_options, fence))
    except OSError as e:
        child.kill()
        raise StorageError(f"upload of {url}: the upload process did not take the request ({e})") from e
    if on_cuttable:
        on_cuttable()
    out = child.proc.stdout
    t0 = time.monotonic()
    ready = select.poll()  # not select(): a long-lived process (a driver, a test session) passes 1,024 fds
    ready.register(out, select.POLLIN)
    while not ready.poll(poll_s * 1000):
        if cancel is not None and cancel.is_set():
            child.kill()
            raise UploadCut(f"upload of {url} cut short")
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            child.kill()  # its connections drop mid-request; the next upload gets a new child
            raise StorageTimeout(f"upload of {url} did not finish within {timeout_s:.1f} s"
                                 f"{f' ({bound})' if bound else ''}: cut short, its upload process killed")
    try:
        answer = _recv(out)
    except (EOFError, OSError, pickle.UnpicklingError) as e:
        child.kill()
        raise StorageError(f"upload of {url}: the upload process died mid-upload "
                           f"(exit code {child.proc.returncode})") from e
    _give_back(child)
    if answer[0] == "ok":
        return True
    if answer[0] == "fenced":
        raise UploadFenced(answer[1])
    if answer[0] == "unconfirmed":
        raise FenceNotConfirmed(answer[1])
    if answer[1] is not None:
        raise answer[1]
    raise UploadFailed(answer[2])


# ---------------------------------------------------------------- object by object, behind the fence
# The fence of the upload running in this asyncio task, for the multipart guard (a context
# variable: the worker's other storage calls share the filesystem instance, not the upload).
_FENCE: contextvars.ContextVar = contextvars.ContextVar("elastic_upload_fence", default=None)


FENCE_DIGITS = 12  # a generation's file name in the fence folder: zero-padded, names sort as numbers


def fence_highest(names: list[str]) -> int | None:
    """The fence a listing of its folder shows (elastic/checkpoint/fencing.py): the highest
    generation, None for none; ValueError naming a name that is not a generation. Here, not in
    fencing.py, because the upload child imports nothing of elastic."""
    numbers = []
    for name in names:
        if not (name.isdigit() and len(name) == FENCE_DIGITS):
            raise ValueError(f"{name[:40]!r}, not a generation")
        numbers.append(int(name))
    return max(numbers, default=None)


def _verdict(names: list[str] | None, error: BaseException | None, fence: tuple[str, int],
             before: str) -> None:
    """Raise unless the fence folder's listing shows the upload's own generation (fail closed)."""
    uri, generation = fence
    if error is not None:
        raise FenceNotConfirmed(f"the fence {uri} cannot be read ({type(error).__name__}: {error}); "
                                f"stopped before {before}")
    try:
        shown = fence_highest(names or [])
    except ValueError as e:
        raise FenceNotConfirmed(f"the fence {uri} holds {e}; stopped before {before}") from None
    if shown is not None and shown > generation:
        raise UploadFenced(f"the run has moved on to generation {shown} (this upload's: {generation}); "
                           f"stopped before {before}")
    if shown != generation:
        shows = f"generation {shown}" if shown is not None else "no generation yet"
        raise FenceNotConfirmed(f"the fence shows {shows}, not this upload's ({generation}); "
                                f"stopped before {before}")


def _names(paths: list) -> list[str]:
    return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in paths]


def check_fence(fs, fence: tuple[str, int], before: str) -> None:
    """List the fence (its folder's URI, generation) through `fs`, bypassing any cached listing;
    raise unless it shows that generation."""
    path = fs._strip_protocol(fence[0])
    try:
        fs.invalidate_cache(path)
        names, error = _names(fs.ls(path, detail=False)), None
    except FileNotFoundError:
        names, error = [], None
    except Exception as e:  # noqa: BLE001 - any failure to read is a "no"
        names, error = None, e
    _verdict(names, error, fence, before)


async def _check_fence_async(fs, fence: tuple[str, int], before: str) -> None:
    path = fs._strip_protocol(fence[0])
    try:
        fs.invalidate_cache(path)
        names, error = _names(await fs._ls(path, detail=False)), None
    except FileNotFoundError:
        names, error = [], None
    except Exception as e:  # noqa: BLE001 - any failure to read is a "no"
        names, error = None, e
    _verdict(names, error, fence, before)


def _plan(fs, src: str, dst: str) -> tuple[list[str], list[tuple[str, str]]]:
    """What `fs.put(src, dst, recursive=True)` does, as fsspec plans it: the remote folders to
    make, and the (local, remote) pairs of files, in order."""
    from fsspec.implementations.local import LocalFileSystem, make_path_posix
    from fsspec.utils import other_paths

    lpaths = LocalFileSystem().expand_path(make_path_posix(src), recursive=True)
    rpaths = other_paths(lpaths, fs._strip_protocol(dst))
    dirs = [r for l, r in zip(lpaths, rpaths) if os.path.isdir(l)]
    return dirs, [(l, r) for l, r in zip(lpaths, rpaths) if not os.path.isdir(l)]


def _guard_multipart(fs) -> None:
    """s3fs completes a multipart upload with one request, after all its parts: read the fence
    right before it, for an upload that carries one (`_FENCE`). A "no" raised there makes s3fs
    abort the multipart upload, so its parts never become an object. Other filesystems are checked
    per object only."""
    call = getattr(fs, "_call_s3", None)
    if call is None or getattr(call, "fence_guard", False):
        return

    async def guarded(method, *args, **kwargs):
        fence = _FENCE.get()
        if fence is not None and method == "complete_multipart_upload":
            await _check_fence_async(fs, fence, f"completing the multipart upload of {kwargs.get('Key')}")
        return await call(method, *args, **kwargs)

    guarded.fence_guard = True
    fs._call_s3 = guarded


def put_tree(fs, src: str, dst: str, fence: tuple[str, int] | None = None) -> None:
    """`fs.put(src, dst, recursive=True)`; with `fence` (its URI, this upload's generation) one
    object at a time, each after a read of the fence that shows this generation (and on s3fs, each
    multipart upload completed after another): `UploadFenced` or `FenceNotConfirmed` otherwise."""
    if fence is None:
        fs.put(src, dst, recursive=True)
    elif getattr(fs, "async_impl", False):
        import fsspec.asyn
        fsspec.asyn.sync(fs.loop, put_tree_async, fs, src, dst, fence)
    else:
        dirs, files = _plan(fs, src, dst)
        for d in dirs:
            fs.makedirs(d, exist_ok=True)
        for local, remote in files:
            check_fence(fs, fence, remote)
            fs.put_file(local, remote)


async def put_tree_async(fs, src: str, dst: str, fence: tuple[str, int] | None = None) -> None:
    """`put_tree` as a coroutine on an async filesystem's loop (cancelling it cuts the upload)."""
    if fence is None:
        await fs._put(src, dst, recursive=True)
        return
    _guard_multipart(fs)
    _FENCE.set(fence)  # this task's context only, and the part uploads it starts
    dirs, files = _plan(fs, src, dst)
    for d in dirs:
        await fs._makedirs(d, exist_ok=True)
    for local, remote in files:
        await _check_fence_async(fs, fence, remote)
        await fs._put_file(local, remote)


# ---------------------------------------------------------------- the child
def _exit_with(parent_pid: int) -> None:
    """Ends this process soon after its parent's death, even mid-upload."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(0)


def _serve(parent_pid: int) -> None:
    import fsspec

    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing a library prints may reach the answers' stream
    threading.Thread(target=_exit_with, args=(parent_pid,), daemon=True).start()
    while True:
        try:
            op, src, url, options, fence = _recv(requests)
        except EOFError:
            return
        try:
            fs, path = fsspec.core.url_to_fs(url, **options)  # "start": only this (fsspec caches it)
            if op == "put":
                put_tree(fs, src.rstrip("/") + "/", path.rstrip("/") + "/", fence)
            answer = ("ok",)
        except UploadFenced as e:  # this module's classes are __main__'s here: sent by name
            answer = ("fenced", str(e))
        except FenceNotConfirmed as e:
            answer = ("unconfirmed", str(e))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the worker
            try:
                pickle.loads(pickle.dumps(e))
                answer = ("error", e, None)
            except Exception:  # noqa: BLE001 - an exception that does not survive pickling
                answer = ("error", None, f"{type(e).__name__}: {e}")
        _send(answers, answer)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
