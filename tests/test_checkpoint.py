"""The commit protocol, retention and background persist, on memory:// (and a flaky variant)."""
import uuid
from datetime import timedelta

import fsspec
import pytest
import torch
import torch.distributed as dist
from fsspec.implementations.memory import MemoryFileSystem

from elastic.checkpoint import (
    COMMIT_MARKER, MANIFEST, AsyncCheckpointer, Manifest, apply_retention, commit, committed_checkpoints,
    latest_committed, load_shards, step_dir)
from elastic.storage import Storage, join


@pytest.fixture
def store():
    root = f"memory://ckpt-{uuid.uuid4().hex}/run/checkpoints"
    return Storage(root), root


def fake_checkpoint(storage, root, step, committed=True, corrupt=False):
    folder = step_dir(root, step)
    storage.write_bytes(join(folder, "__0_0.distcp"), b"x" * 100)
    storage.write_bytes(join(folder, ".metadata"), b"m" * 10)
    if committed:
        files = {"__0_0.distcp": 100, ".metadata": 10}
        commit(storage, folder, Manifest(step, step * 8, 2, "ddp", files, 0.0))
    if corrupt:  # a shard truncated after the commit
        storage.write_bytes(join(folder, "__0_0.distcp"), b"x" * 7)
    return folder


def test_uncommitted_checkpoints_do_not_exist(store):
    storage, root = store
    fake_checkpoint(storage, root, 10)
    fake_checkpoint(storage, root, 20, committed=False)
    skipped = []
    latest = latest_committed(storage, root, on_skip=lambda uri, why: skipped.append((uri, why)))
    assert latest.step == 10
    assert skipped == [(step_dir(root, 20), "no commit marker (persist did not finish)")]


def test_corrupt_latest_is_skipped_with_a_reason(store):
    storage, root = store
    fake_checkpoint(storage, root, 10)
    fake_checkpoint(storage, root, 20, corrupt=True)
    skipped = []
    assert latest_committed(storage, root, lambda u, w: skipped.append(w)).step == 10
    assert skipped == ["file __0_0.distcp has 7 bytes, manifest says 100"]


def test_marker_is_written_after_the_manifest(store, monkeypatch):
    storage, root = store
    order = []
    real = storage.write_bytes
    monkeypatch.setattr(storage, "write_bytes", lambda uri, data: (order.append(uri.rsplit("/", 1)[1]), real(uri, data)))
    commit(storage, step_dir(root, 5), Manifest(5, 40, 1, "ddp", {}, 0.0))
    assert order == [MANIFEST, COMMIT_MARKER]


def test_retention_keeps_newest_and_leaves_newer_partials(store):
    storage, root = store
    for s in (10, 20, 30, 40):
        fake_checkpoint(storage, root, s)
    fake_checkpoint(storage, root, 15, committed=False)  # abandoned: older than the newest commit
    fake_checkpoint(storage, root, 50, committed=False)  # maybe a persist in flight: keep
    removed = apply_retention(storage, root, num_to_keep=2)
    assert sorted(r.rsplit("_", 1)[1] for r in removed) == ["000000010", "000000015", "000000020"]
    kept = [c.step for c in committed_checkpoints(storage, root)]
    assert kept == [40, 30]
    assert storage.exists(step_dir(root, 50))


def test_retention_never_removes_the_newest_committed(store):
    storage, root = store
    fake_checkpoint(storage, root, 10)
    fake_checkpoint(storage, root, 20, corrupt=True)  # the newest folder, but not a valid checkpoint
    apply_retention(storage, root, num_to_keep=1)
    assert latest_committed(storage, root).step == 10


# ---------------------------------------------------------------- background persist through DCP

class FlakyMemoryFS(MemoryFileSystem):
    """memory:// that fails the next `failures` writes: a brief storage outage."""

    protocol = "flakymem"
    failures = 0

    def _open(self, path, mode="rb", **kw):
        if "w" in mode and FlakyMemoryFS.failures > 0:
            FlakyMemoryFS.failures -= 1
            raise ConnectionError("storage unavailable (injected)")
        return super()._open(path, mode, **kw)


fsspec.register_implementation("flakymem", FlakyMemoryFS, clobber=True)


@pytest.fixture
def one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def model_state(seed):
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 3)
    return {"model": {k: v.detach().clone() for k, v in m.state_dict().items()}}


@pytest.mark.parametrize("protocol", ["memory", "flakymem"])
def test_async_persist_commits_and_survives_a_storage_blip(one_rank_group, protocol):
    root = f"{protocol}://bucket-{uuid.uuid4().hex}/run/checkpoints"
    storage = Storage(root)
    FlakyMemoryFS.failures = 2 if protocol == "flakymem" else 0
    ck = AsyncCheckpointer(storage, root, rank=0, world_size=1, strategy="ddp", process_group=one_rank_group,
                           retries=3, backoff_s=0.01, num_to_keep=2)
    state = model_state(0)
    ck.save(step=10, cursor=80, state=state, metrics={"loss": 1.5})
    state["model"]["weight"].add_(1.0)  # training goes on: the snapshot must not see this
    ck.wait()
    (res,) = ck.drain()
    assert res.committed and res.step == 10
    assert res.attempts == (3 if protocol == "flakymem" else 1)
    latest = latest_committed(storage, root)
    assert latest.step == 10 and latest.manifest.cursor == 80 and latest.manifest.metrics == {"loss": 1.5}
    restored = model_state(1)
    load_shards(restored, latest.uri, {}, one_rank_group)
    assert torch.equal(restored["model"]["weight"], model_state(0)["model"]["weight"])


def test_persist_that_never_succeeds_is_never_committed(one_rank_group):
    root = f"flakymem://bucket-{uuid.uuid4().hex}/run/checkpoints"
    FlakyMemoryFS.failures = 10_000
    ck = AsyncCheckpointer(Storage(root), root, 0, 1, "ddp", one_rank_group, retries=2, backoff_s=0.0,
                           num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    FlakyMemoryFS.failures = 0
    (res,) = ck.drain()
    assert not res.committed and "storage unavailable" in res.error
    assert latest_committed(Storage(root), root) is None
