"""Checkpoint uploads in a child process (elastic/checkpoint/uploader.py): real child processes,
local disk and SeaweedFS behind a slow link."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from elastic.checkpoint import uploader


def _folder(path, files: dict[str, bytes]) -> str:
    os.makedirs(path)
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return str(path)


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:  # a zombie (dead, not yet reaped by whoever its parent is now) counts as gone
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _no_children() -> None:
    uploader.ready(30)  # let a child that is starting finish, then drop them all
    for child in uploader._idle:
        child.kill()
    uploader._idle.clear()


def _started(url: str) -> None:
    uploader.prestart(url, {})
    assert uploader.ready(30)


@pytest.mark.timeout(60)
def test_a_folder_is_uploaded_by_a_child_process_kept_for_the_next_upload(tmp_path):
    src = _folder(tmp_path / "src", {"a.distcp": os.urandom(100_000), ".metadata": b"index"})
    _started(f"file://{tmp_path}")
    assert uploader.put(src, f"file://{tmp_path}/dst1", {})
    (child,) = uploader._idle
    assert uploader.put(src, f"file://{tmp_path}/dst2", {})
    assert uploader._idle == [child] and child.alive()  # the same process served both
    assert child.proc.pid != os.getpid()
    for dst in ("dst1", "dst2"):
        for name in ("a.distcp", ".metadata"):
            assert (tmp_path / dst / name).read_bytes() == (tmp_path / "src" / name).read_bytes()


@pytest.mark.timeout(60)
def test_an_upload_from_a_process_past_1024_fds_is_waited_on(tmp_path):
    """CI's test session had passed 1,024 open fds by the time it got here: select() refused
    the child's pipe ("filedescriptor out of range") and every upload failed. A driver or a
    worker that lives long does the same."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} fds per process")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        _no_children()
        src = _folder(tmp_path / "src", {"a.distcp": b"x" * 1000})
        _started(f"file://{tmp_path}")
        (child,) = uploader._idle
        assert child.proc.stdout.fileno() > 1024
        assert uploader.put(src, f"file://{tmp_path}/dst", {})
        assert (tmp_path / "dst" / "a.distcp").read_bytes() == b"x" * 1000
    finally:
        _no_children()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(60)
def test_the_childs_error_is_raised_in_the_worker_as_the_same_exception(tmp_path):
    src = _folder(tmp_path / "src", {"a": b"x"})
    (tmp_path / "blocker").write_bytes(b"a file where the upload wants a folder")
    _started(f"file://{tmp_path}")
    with pytest.raises(OSError) as raised:
        uploader.put(src, f"file://{tmp_path}/blocker/dst", {})
    import fsspec
    with pytest.raises(OSError) as direct:  # the same put in this process
        fsspec.filesystem("file").put(src + "/", f"{tmp_path}/blocker/dst/", recursive=True)
    assert type(raised.value) is type(direct.value)
    assert uploader._idle and uploader._idle[0].alive()  # a failed upload leaves its child usable
    assert uploader.put(src, f"file://{tmp_path}/ok", {})
    assert (tmp_path / "ok" / "a").read_bytes() == b"x"


@pytest.mark.timeout(60)
def test_with_no_child_idle_an_upload_is_left_to_the_worker(tmp_path):
    """put() never waits for a child to start: on a busy node that took seconds, past the steps a
    chaos test's outage allowed the first persist. It starts none either (save_shards does, after
    its own upload: see the next test)."""
    _no_children()
    src = _folder(tmp_path / "src", {"a": b"x"})
    assert uploader.put(src, f"file://{tmp_path}/dst", {}) is False
    assert not (tmp_path / "dst").exists()  # nothing done: the caller uploads itself
    assert not uploader._starting and not uploader._idle


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_a_workers_first_upload_is_its_own_and_the_next_ones_are_the_childs(s3_server, monkeypatch):
    import torch

    from elastic.checkpoint import dcp_io, loading
    _no_children()
    in_worker = []
    real_upload = dcp_io.upload
    monkeypatch.setattr(dcp_io, "upload", lambda *a, **k: (in_worker.append(a[2]), real_upload(*a, **k)))
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    root = f"{s3_server.uri}/first-{uuid.uuid4().hex[:8]}"
    dcp_io.save_shards(state, f"{root}/a", s3_server.storage_options, None)
    assert len(in_worker) == 1
    assert uploader.ready(30)  # started once the first upload had ended
    (child,) = uploader._idle
    dcp_io.save_shards(state, f"{root}/b", s3_server.storage_options, None)
    assert len(in_worker) == 1 and uploader._idle == [child]  # the second went through the child
    for name in ("a", "b"):
        back = {"w": torch.zeros(1000)}
        loading.load_shards(back, f"{root}/{name}", s3_server.storage_options, None)
        assert torch.equal(back["w"], state["w"])


def test_a_cancelled_upload_is_not_begun(tmp_path):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(uploader.UploadCut, match="not begun"):
        uploader.put(str(tmp_path), f"file://{tmp_path}/dst", {}, cancel)
    assert not (tmp_path / "dst").exists()


def _slow_s3(s3_server, bytes_per_s: float):
    from tests.support.slow_link import SlowLink
    host, port = s3_server.endpoint_url.rsplit("/", 1)[1].split(":")
    return SlowLink(host, int(port), bytes_per_s=bytes_per_s)


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_a_cut_upload_kills_its_child_at_once_and_the_next_upload_gets_a_new_one(s3_server, tmp_path):
    """Cut, put() returns and its child is gone before the upload could have ended: the shard
    takes 20 s through the link, and it never lands."""
    src = _folder(tmp_path / "src", {"shard": os.urandom(4_000_000)})  # 20 s through 200 kB/s
    cut_dst = f"{s3_server.uri}/cut-{uuid.uuid4().hex[:8]}"
    with _slow_s3(s3_server, 200_000) as link:
        options = {**s3_server.storage_options, "endpoint_url": link.url}
        cancel, cuttable, errors = threading.Event(), threading.Event(), []

        _started(s3_server.uri)

        def run():
            try:
                assert uploader.put(src, cut_dst, options, cancel, cuttable.set)
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        assert cuttable.wait(30)
        time.sleep(1.0)  # well into the upload
        busy = [int(p) for p in subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "uploader.py"],
                                               capture_output=True, text=True).stdout.split()]
        assert busy, "no upload process"
        cancel.set()
        t.join(60)  # a backstop: an upload that ran on would have ended (and landed) by then
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], uploader.UploadCut), errors
        assert all(_gone(pid, 60) for pid in busy), "the cut upload's process runs on"
        # Gone before its upload could have ended: had it run on, the shard would be there.
        assert not s3_server.filesystem().exists(f"{cut_dst.split('://', 1)[1]}/shard")
    dst = f"{s3_server.uri}/whole-{uuid.uuid4().hex[:8]}"
    _started(s3_server.uri)
    assert uploader.put(src, dst, s3_server.storage_options)  # a fresh child, at full speed
    assert s3_server.filesystem().cat_file(f"{dst.split('://', 1)[1]}/shard") == (tmp_path / "src" / "shard").read_bytes()


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_an_upload_process_dies_with_its_worker_even_mid_upload(s3_server, tmp_path):
    """A worker SIGKILLed (a node's OOM killer, a chaos kill) runs no cleanup: its upload's
    process must not upload on, for minutes, into a checkpoint nobody will commit."""
    src = _folder(tmp_path / "src", {"shard": os.urandom(4_000_000)})  # 20 s through 200 kB/s
    orphan = f"{s3_server.uri}/orphan-{uuid.uuid4().hex[:8]}"
    with _slow_s3(s3_server, 200_000) as link:
        options = {**s3_server.storage_options, "endpoint_url": link.url}
        worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import sys, threading
            from elastic.checkpoint import uploader
            cuttable = threading.Event()
            uploader.prestart({s3_server.uri!r}, {{}})
            assert uploader.ready(60)
            threading.Thread(target=uploader.put, daemon=True,
                             args=({src!r}, {orphan!r}, {options!r}, None, cuttable.set)).start()
            cuttable.wait(60)
            print("uploading", flush=True)
            threading.Event().wait()
        """)], stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout.readline().strip() == "uploading"
            time.sleep(1.0)
            (child,) = [int(p) for p in subprocess.run(["pgrep", "-P", str(worker.pid)], capture_output=True,
                                                       text=True).stdout.split()]
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            assert _gone(child, 60), "the upload process outlived its worker"
            # Gone before its upload could have ended: had it run on, the shard would be there.
            assert not s3_server.filesystem().exists(f"{orphan.split('://', 1)[1]}/shard")
        finally:
            worker.kill()


def test_only_filesystems_a_fresh_interpreter_can_reach_upload_in_a_child():
    import fsspec

    from elastic.checkpoint.dcp_io import _process_private
    from tests.support.flaky_fs import flaky_memory_fs
    assert _process_private(fsspec.filesystem("memory"))  # this process's memory
    assert _process_private(flaky_memory_fs("uploaderflaky")())  # registered at run time, and in memory
    assert not _process_private(fsspec.filesystem("file"))
    assert not _process_private(fsspec.filesystem("s3", anon=True))


@pytest.mark.timeout(60)
def test_a_child_started_ahead_serves_the_first_upload(tmp_path):
    _no_children()
    uploader.prestart(f"file://{tmp_path}/dst", {})
    uploader.prestart(f"file://{tmp_path}/dst", {})  # one is starting: nothing more
    assert len(uploader._starting) <= 1
    assert uploader.ready(30)
    (ready,) = uploader._idle
    src = _folder(tmp_path / "src", {"a": b"first"})
    assert uploader.put(src, f"file://{tmp_path}/dst", {})
    assert uploader._idle == [ready] and (tmp_path / "dst" / "a").read_bytes() == b"first"
    uploader.prestart(f"file://{tmp_path}/dst", {})  # one is idle: nothing more
    assert not uploader._starting and uploader._idle == [ready]


# ---------------------------------------------------------------- the fence, object by object
def _fence_file(tmp_path, generation, *others: str) -> tuple[str, int]:
    """A fence on local disk showing `generation` (and any `others` names in its folder);
    returns what an upload of generation 1 checks."""
    folder = tmp_path / "fence"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for name in (f"{generation:012d}", *others):
        (folder / name).write_bytes(b"")
    return f"file://{folder}", 1


@pytest.mark.timeout(60)
def test_the_child_uploads_only_while_the_fence_shows_its_generation(tmp_path):
    src = _folder(tmp_path / "src", {"a.distcp": b"shard", ".metadata": b"index"})
    _started(f"file://{tmp_path}")
    assert uploader.put(src, f"file://{tmp_path}/ok", {}, fence=_fence_file(tmp_path, 1))
    assert sorted(os.listdir(tmp_path / "ok")) == [".metadata", "a.distcp"]
    with pytest.raises(uploader.UploadFenced, match="moved on to generation 2"):
        uploader.put(src, f"file://{tmp_path}/moved", {}, fence=_fence_file(tmp_path, 2))
    assert not os.listdir(tmp_path / "moved")  # not one object
    for junk in ("junk", "12"):  # unreadable: fail closed too, as a storage error (retried)
        with pytest.raises(uploader.FenceNotConfirmed, match="not a generation"):
            uploader.put(src, f"file://{tmp_path}/junk", {}, fence=_fence_file(tmp_path, 1, junk))
    with pytest.raises(uploader.FenceNotConfirmed, match="shows no generation"):
        uploader.put(src, f"file://{tmp_path}/gone", {}, fence=(f"file://{tmp_path}/nowhere/fence", 1))
    assert uploader._idle and uploader._idle[0].alive()  # a fenced upload leaves its child usable
    assert uploader.put(src, f"file://{tmp_path}/again", {}, fence=_fence_file(tmp_path, 1))


def test_an_upload_reads_the_fence_before_each_object(tmp_path, monkeypatch):
    """The run moves on between two objects of one upload: the second is never written."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
    src = _folder(tmp_path / "src", {"a": b"1", "b": b"2", "c": b"3"})
    fence = _fence_file(tmp_path, 1)
    done, real = [], LocalFileSystem.put_file

    def put_file(self, lpath, rpath, *args, **kwargs):
        real(self, lpath, rpath, *args, **kwargs)
        done.append(os.path.basename(rpath))
        (tmp_path / "fence" / f"{2:012d}").write_bytes(b"")
    monkeypatch.setattr(LocalFileSystem, "put_file", put_file)
    with pytest.raises(uploader.UploadFenced, match="stopped before"):
        uploader.put_tree(fsspec.filesystem("file"), src + "/", f"{tmp_path}/dst/", fence)
    assert len(done) == 1 and sorted(os.listdir(tmp_path / "dst")) == done


@pytest.mark.parametrize("moves", [False, True])
def test_a_multipart_upload_is_completed_only_after_the_fence_is_read_again(tmp_path, moves):
    """s3fs's own multipart upload, its requests answered here: the fence is read right before
    the upload is completed; if the run moved on while the parts went up, s3fs aborts it."""
    import fsspec.asyn
    import s3fs

    fs = s3fs.S3FileSystem(anon=True, skip_instance_cache=True)
    shown, calls = {"fence": [f"bucket/run/checkpoints/fence/{1:012d}"]}, []

    async def call_s3(method, *args, **kwargs):
        calls.append(method)
        if method == "upload_part" and moves:
            shown["fence"] = [*shown["fence"], f"bucket/run/checkpoints/fence/{2:012d}"]
        return {"UploadId": "u"} if method == "create_multipart_upload" else {"ETag": "e"}

    async def ls(path, **kwargs):
        calls.append(f"read {path}")
        return shown["fence"]

    fs._call_s3, fs._ls = call_s3, ls
    uploader._guard_multipart(fs)
    uploader._guard_multipart(fs)  # once per filesystem, however often asked
    big = tmp_path / "shard"
    big.write_bytes(os.urandom(10 * 2 ** 20 + 1))  # three 5 MiB parts

    async def upload():
        uploader._FENCE.set(("s3://bucket/run/checkpoints/fence", 1))
        await fs._put_file(str(big), "bucket/run/checkpoints/step_1/shard", chunksize=5 * 2 ** 20)

    if moves:
        with pytest.raises(uploader.UploadFenced, match="completing the multipart upload"):
            fsspec.asyn.sync(fs.loop, upload)
        assert calls[-2:] == ["read bucket/run/checkpoints/fence", "abort_multipart_upload"]
    else:
        fsspec.asyn.sync(fs.loop, upload)
        assert calls[-2:] == ["read bucket/run/checkpoints/fence", "complete_multipart_upload"]
    assert calls.count("upload_part") == 3
    calls.clear()
    fsspec.asyn.sync(fs.loop, fs._put_file, str(big), "bucket/other", chunksize=5 * 2 ** 20)
    assert not any(c.startswith("read") for c in calls)  # an upload without a fence: unchanged


# ---------------------------------------------------------------- an upload that hangs has a deadline
@pytest.fixture
def silent_store():
    """An S3 endpoint that takes every connection and never answers (a hung store, not a refusing
    one): storage options for s3fs pointing at it."""
    import socket
    server = socket.create_server(("127.0.0.1", 0))
    held, done = [], threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(server.accept()[0])  # kept open, never read, never answered
            except OSError:
                pass
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield {"endpoint_url": f"http://127.0.0.1:{server.getsockname()[1]}", "key": "k", "secret": "s"}
    done.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.timeout(60)
def test_an_upload_that_hangs_is_cut_at_its_deadline_naming_the_object_and_the_bound(tmp_path, silent_store):
    """Before, put() polled a child whose request was never answered for as long as it waited."""
    from elastic.storage import StorageError, StorageTimeout
    src = _folder(tmp_path / "src", {"a.distcp": os.urandom(1000)})
    _started("s3://bucket/run")
    (child,) = uploader._idle
    with pytest.raises(StorageTimeout) as raised:
        uploader.put(src, "s3://bucket/run/step_1", silent_store, timeout_s=1.0, bound="the test's bound")
    assert isinstance(raised.value, StorageError)  # retried and reported as any storage failure is
    assert "s3://bucket/run/step_1" in str(raised.value) and "the test's bound" in str(raised.value)
    assert _gone(child.proc.pid, 10) and uploader._idle == []  # killed: its request dropped


@pytest.mark.timeout(60)
def test_a_save_whose_upload_hangs_in_the_worker_fails_within_its_bound(tmp_path, silent_store):
    """A worker's first upload runs in the worker itself (no child yet): cut short there too."""
    import torch

    from elastic.checkpoint import dcp_io
    from elastic.storage import StorageTimeout
    _no_children()
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with pytest.raises(StorageTimeout, match=r"checkpoint\.upload_timeout_s=0\.5 \+ .* MB at "
                                             r"checkpoint\.upload_min_mb_per_s=100"):
        dcp_io.save_shards(state, "s3://bucket/run/step_2", silent_store, None,
                           upload_bound=dcp_io.UploadBound(0.5, 100.0))
