"""The SeaweedFS S3 test server, exercised through fsspec/s3fs and DCP."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import uuid
import warnings

import botocore.exceptions
import fsspec
import pytest
from fsspec.asyn import sync

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]


def _prefix(s3_server, name: str) -> str:
    # the bucket is shared by the whole session
    return f"{s3_server.bucket}/{name}-{uuid.uuid4().hex[:8]}"


def test_roundtrip(s3_server):
    fs, root = fsspec.core.url_to_fs(s3_server.uri, **s3_server.storage_options)
    assert root == s3_server.bucket
    base = _prefix(s3_server, "roundtrip")

    fs.pipe(f"{base}/a.txt", b"hello")
    with fs.open(f"{base}/sub/b.bin", "wb") as f:
        f.write(b"\x00\x01")
    assert fs.ls(base, detail=False) == [f"{base}/a.txt", f"{base}/sub"]
    assert fs.find(base) == [f"{base}/a.txt", f"{base}/sub/b.bin"]
    assert fs.cat(f"{base}/a.txt") == b"hello"
    assert fs.info(f"{base}/sub/b.bin")["size"] == 2

    # An object written through another client shows up at once: listings are
    # not cached (use_listings_cache=False).
    s3_server.filesystem().pipe(f"{base}/c.txt", b"c")
    assert f"{base}/c.txt" in fs.ls(base, detail=False)

    fs.rm(base, recursive=True)
    assert not fs.exists(f"{base}/a.txt")
    # SeaweedFS quirk (unlike AWS): the emptied "directories" stay visible as
    # common prefixes until its empty-folder cleaner runs (30 s - 2 min later).
    leftovers = fs.find(base, withdirs=True, detail=True)
    assert all(info["type"] == "directory" for info in leftovers.values()), leftovers


def test_credentials_are_checked(s3_server):
    wrong = s3_server.filesystem(secret="not-the-secret")
    with pytest.raises(PermissionError):
        wrong.ls(s3_server.bucket)
    anon = s3_server.filesystem(key=None, secret=None, anon=True)
    with pytest.raises(PermissionError):
        anon.ls(s3_server.bucket)


def test_large_object(s3_server):
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    base = _prefix(s3_server, "large")
    data = os.urandom(20 * 2**20)
    digest = hashlib.sha256(data).hexdigest()

    t0 = time.monotonic()
    fs.pipe(f"{base}/single", data)  # one PutObject
    # 5 MiB blocks (the S3 minimum part size) force a multipart upload
    with fs.open(f"{base}/multipart", "wb", block_size=5 * 2**20) as f:
        for i in range(0, len(data), 2**20):
            f.write(data[i : i + 2**20])
    write_s = time.monotonic() - t0

    t0 = time.monotonic()
    for key in ("single", "multipart"):
        assert fs.size(f"{base}/{key}") == len(data)
        assert hashlib.sha256(fs.cat(f"{base}/{key}")).hexdigest() == digest
    read_s = time.monotonic() - t0
    # ranged read from the middle of a multipart object
    with fs.open(f"{base}/multipart", "rb") as f:
        f.seek(7 * 2**20 + 3)
        assert f.read(100) == data[7 * 2**20 + 3 : 7 * 2**20 + 103]

    print(f"40 MiB written in {write_s:.2f}s, read in {read_s:.2f}s")
    fs.rm(base, recursive=True)


def test_outage_write_fails_then_recovers(s3_server):
    # A dedicated client with short timeouts and no retries, so that a failure
    # during the outage shows up in seconds instead of minutes.
    fs = s3_server.filesystem(
        config_kwargs={"connect_timeout": 2, "read_timeout": 2, "retries": {"total_max_attempts": 1}}
    )
    fs.retries = 1
    base = _prefix(s3_server, "outage")
    fs.pipe(f"{base}/before", b"before")  # also opens a pooled connection

    async def put(name: str, deadline: float) -> None:
        # botocore sends PUTs with "Expect: 100-continue" and aiohttp applies no
        # read timeout while waiting for the 100, so a PUT to a stalled server
        # hangs forever; only a caller-side deadline turns it into a failure.
        await asyncio.wait_for(fs._pipe_file(f"{base}/{name}", b"payload"), deadline)

    with s3_server.outage():
        with pytest.raises(TimeoutError):
            sync(fs.loop, put, "during", 3)
        # reads do honour read_timeout: they fail (ReadTimeoutError) instead of hanging
        with pytest.raises(botocore.exceptions.ReadTimeoutError):
            fs.cat(f"{base}/before")

    # Once the server answers again, a write lands (the deadline only keeps a hang from
    # holding the test: it is far past what one small PUT takes).
    sync(fs.loop, put, "after", 60)
    assert fs.cat(f"{base}/after") == b"payload"
    assert fs.cat(f"{base}/before") == b"before"
    fs.rm(base, recursive=True)


def test_dcp_roundtrip_s3(s3_server):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = s3_server.storage_options
    path = f"s3://{_prefix(s3_server, 'dcp')}/step-1"
    state = {
        "model": {"w": torch.randn(128, 64), "b": torch.arange(10)},
        "step": 7,
        "meta": {"run": "abc"},
    }

    def save(**writer_kwargs):
        with warnings.catch_warnings():
            # "torch.distributed is ... uninitialized" and "overwriting" notices
            warnings.simplefilter("ignore", UserWarning)
            # Quirks: never also pass checkpoint_id= -- dcp then calls
            # writer.reset(checkpoint_id), which re-creates the filesystem
            # *without* the storage options (NoCredentialsError). And
            # sync_files=True makes DCP fall back to a machine-wide os.sync()
            # per file, since s3fs files have no fileno().
            dcp.save(state, storage_writer=FsspecWriter(path, sync_files=False, **writer_kwargs, **opts), no_dist=True)

    save()
    save(thread_count=2)  # overwrite in place (overwrite=True is the default)
    fs = fsspec.filesystem("s3", **opts)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.find(path.removeprefix("s3://")))
    assert names == [".metadata", "__0_0.distcp", "__0_1.distcp"]

    # overwrite=False refuses; DCP wraps errors in CheckpointException, which is
    # a BaseException, not an Exception.
    with pytest.raises(dcp.api.CheckpointException):
        save(overwrite=False)

    target = {
        "model": {"w": torch.zeros(128, 64), "b": torch.zeros(10, dtype=torch.long)},
        "step": 0,
        "meta": {"run": ""},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=FsspecReader(path, **opts), no_dist=True)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert torch.equal(target["model"]["b"], state["model"]["b"])
    assert target["step"] == 7
    assert target["meta"] == {"run": "abc"}
    fs.rm(path.removeprefix("s3://"), recursive=True)
