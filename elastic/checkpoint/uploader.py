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

Cutting an upload short (the group failed, see `AsyncCheckpointer.abort`) kills the child:
its connections drop mid-request, on any filesystem. A multipart upload cut short stays
incomplete in the bucket, invisible to readers, until the store's lifecycle rule removes it.

The child runs this file as a script and imports nothing of elastic (whose package imports
Ray and torch): only fsspec and the filesystem's own package.
"""
from __future__ import annotations

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
        _send(child.proc.stdin, ("start", None, url, storage_options))
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
        on_cuttable=None, poll_s: float = POLL_S) -> bool:
    """Upload the local folder `src` to `url` (an fsspec URL), as `fs.put(src, path,
    recursive=True)` would, in an idle child process; True once done. False, having done
    nothing, when no child is idle (none started yet, or the one there is busy): the caller
    uploads itself, then calls `prestart` for the next upload. Cut short within `poll_s` once
    `cancel` is set (`UploadCut`; `on_cuttable` is called as the upload begins). The child's
    error is raised here: the same exception where it pickles, else `UploadFailed` naming it."""
    from elastic.storage import StorageError

    if cancel is not None and cancel.is_set():
        raise UploadCut(f"upload of {url} not begun")
    child = _take_idle()
    if child is None:
        return False
    try:
        _send(child.proc.stdin, ("put", src, url, storage_options))
    except OSError as e:
        child.kill()
        raise StorageError(f"upload of {url}: the upload process did not take the request ({e})") from e
    if on_cuttable:
        on_cuttable()
    out = child.proc.stdout
    while not select.select([out], [], [], poll_s)[0]:
        if cancel is not None and cancel.is_set():
            child.kill()
            raise UploadCut(f"upload of {url} cut short")
    try:
        answer = _recv(out)
    except (EOFError, OSError, pickle.UnpicklingError) as e:
        child.kill()
        raise StorageError(f"upload of {url}: the upload process died mid-upload "
                           f"(exit code {child.proc.returncode})") from e
    _give_back(child)
    if answer[0] == "ok":
        return True
    if answer[1] is not None:
        raise answer[1]
    raise UploadFailed(answer[2])


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
            op, src, url, options = _recv(requests)
        except EOFError:
            return
        try:
            fs, path = fsspec.core.url_to_fs(url, **options)  # "start": only this (fsspec caches it)
            if op == "put":
                fs.put(src.rstrip("/") + "/", path.rstrip("/") + "/", recursive=True)
            answer = ("ok",)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the worker
            try:
                pickle.loads(pickle.dumps(e))
                answer = ("error", e, None)
            except Exception:  # noqa: BLE001 - an exception that does not survive pickling
                answer = ("error", None, f"{type(e).__name__}: {e}")
        _send(answers, answer)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
