"""The commit protocol, retention and background persist, on memory:// (and a flaky variant)."""
import json
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.checkpoint.loading import load_shards
from elastic.checkpoint.layout import (
    COMMIT_MARKER, MANIFEST, Manifest, commit, committed_checkpoints, latest_committed, step_dir)
from elastic.checkpoint.retention import apply_retention
from elastic.checkpoint.persister import AsyncCheckpointer
from tests.support.flaky_fs import flaky_memory_fs
from tests.spawn_ranks import rendezvous_port
from elastic.storage import Storage, StorageError, join


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

FlakyMemoryFS = flaky_memory_fs("flakymem")


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


# ---------------------------------------------------------------- the three phases of a persist

def count_saves(monkeypatch):
    """Count the collective shard saves a persist makes (each one is a dcp.save on the group)."""
    import elastic.checkpoint.persister as ckpt
    calls = []
    real = ckpt.save_shards

    def counting(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)
    monkeypatch.setattr(ckpt, "save_shards", counting)
    return calls


def failing_writes(storage, monkeypatch, name, times=10_000):
    """Writes of files called `name` fail `times` times: an outage that hits only the commit."""
    real = storage.write_bytes
    left = [times]

    def write(uri, data):
        if uri.rsplit("/", 1)[1] == name and left[0] > 0:
            left[0] -= 1
            from elastic.storage import StorageError
            raise StorageError(f"write {uri} failed: ConnectionError: injected")
        return real(uri, data)
    monkeypatch.setattr(storage, "write_bytes", write)


def test_a_failing_commit_is_retried_alone_and_reported_never_the_collective_save(store, one_rank_group, monkeypatch):
    # Re-entering the save would be a collective on rank 0 alone: the other ranks are done with it.
    storage, root = store
    saves = count_saves(monkeypatch)
    failing_writes(storage, monkeypatch, COMMIT_MARKER)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=2, backoff_s=0.0, num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert saves == [step_dir(root, 10)]
    assert not res.committed and res.error.startswith(f"commit of {step_dir(root, 10)} failed after 3 attempt(s)")
    assert COMMIT_MARKER not in storage.sizes(step_dir(root, 10))
    assert latest_committed(storage, root) is None


def test_a_commit_that_recovers_within_its_retries_commits(store, one_rank_group, monkeypatch):
    storage, root = store
    saves = count_saves(monkeypatch)
    failing_writes(storage, monkeypatch, MANIFEST, times=2)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=2, backoff_s=0.0, num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert res.committed and res.attempts == 1 and len(saves) == 1
    assert latest_committed(storage, root).step == 10


def test_a_retention_error_is_logged_and_nothing_is_redone(store, one_rank_group, monkeypatch):
    import elastic.checkpoint.persister as ckpt
    storage, root = store
    saves = count_saves(monkeypatch)

    def broken_retention(*a, **kw):
        raise StorageError(f"list {root} failed: ConnectionError: injected")
    monkeypatch.setattr(ckpt, "apply_retention", broken_retention)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=2, backoff_s=0.0, num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()  # one result: the commit, reported once
    assert res.committed and res.error is None and len(saves) == 1


# ---------------------------------------------------------------- a step saved again (redone after a recovery)

def test_a_redone_step_reports_the_existing_commit_and_never_rewrites_it(store, one_rank_group, monkeypatch):
    storage, root = store
    first = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    first.save(10, 80, model_state(0), {"loss": 1.5})
    first.wait()
    folder = step_dir(root, 10)
    before = {n: storage.read_bytes(join(folder, n)) for n in storage.sizes(folder)}
    # The group was lost after the commit, restored from an older checkpoint, and recomputed step 10.
    saves = count_saves(monkeypatch)
    again = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    again.save(10, 80, model_state(1), {"loss": 9.9})
    again.wait()
    assert saves == []
    assert {n: storage.read_bytes(join(folder, n)) for n in storage.sizes(folder)} == before
    restored = model_state(2)
    load_shards(restored, folder, {}, one_rank_group)
    assert torch.equal(restored["model"]["weight"], model_state(0)["model"]["weight"])
    (res,) = again.drain()
    assert res.committed and res.reused and res.uri == folder and res.metrics == {"loss": 1.5}


def test_leftovers_of_a_lost_attempt_never_become_part_of_the_checkpoint(store, one_rank_group):
    storage, root = store
    folder = step_dir(root, 10)
    # An attempt at a larger world size died before its commit: shards of ranks that no longer exist.
    storage.write_bytes(join(folder, "__5_0.distcp"), b"old" * 10)
    storage.write_bytes(join(folder, ".metadata"), b"stale index")
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    latest = latest_committed(storage, root)
    assert sorted(latest.manifest.files) == [".metadata", "__0_0.distcp"]
    assert "__5_0.distcp" not in storage.sizes(folder)
    (res,) = ck.drain()
    assert res.committed and not res.reused


def test_a_damaged_committed_folder_is_not_rewritten(store, one_rank_group):
    storage, root = store
    folder = fake_checkpoint(storage, root, 10, corrupt=True)
    before = {n: storage.read_bytes(join(folder, n)) for n in storage.sizes(folder)}
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert not res.committed and "never rewritten" in res.error and folder in res.error
    assert {n: storage.read_bytes(join(folder, n)) for n in storage.sizes(folder)} == before


# ---------------------------------------------------------------- what the manifest records; fencing

DATA_ORDER = {"global_batch_size": 48, "seed": 7, "num_samples": 1000}


def test_every_manifest_records_what_the_sample_order_depends_on(store, one_rank_group):
    storage, root = store
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2,
                           data_order=DATA_ORDER)
    ck.save(10, 480, model_state(0), {})
    ck.wait()
    assert latest_committed(storage, root).manifest.data_order == DATA_ORDER


def test_manifests_written_before_data_order_was_recorded_still_load(store):
    storage, root = store
    folder = fake_checkpoint(storage, root, 10)
    old = {"step": 10, "cursor": 80, "world_size": 2, "strategy": "ddp", "created_at": 0.0, "metrics": {},
           "files": {"__0_0.distcp": 100, ".metadata": 10}}
    storage.write_bytes(join(folder, MANIFEST), json.dumps(old).encode())
    latest = latest_committed(storage, root)
    assert latest.step == 10 and latest.manifest.data_order == {}


def test_a_fenced_worker_writes_nothing(store, one_rank_group, monkeypatch):
    storage, root = store
    saves = count_saves(monkeypatch)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=2, backoff_s=0.0, num_to_keep=2,
                           may_write=lambda: False)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert not res.committed and res.error.startswith("fenced:")
    assert saves == [] and storage.list_dir(root) == []


def _still_uploading(storage, root, one_rank_group):
    """A checkpointer whose persist is still running (an upload an earlier, failed group left
    behind), ended by setting the returned event."""
    done = threading.Event()
    old = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    old._thread = threading.Thread(target=done.wait, daemon=True)
    old._thread.start()
    return old, done


def test_a_wait_that_times_out_leaves_the_persist_in_flight(store, one_rank_group):
    storage, root = store
    old, done = _still_uploading(storage, root, one_rank_group)
    old.wait(timeout_s=0.05)
    assert old.in_flight()  # still reported, and still waited for by whoever writes next
    done.set()
    old.wait()
    assert not old.in_flight()


def test_a_persist_waits_for_an_abandoned_upload_before_writing(store, one_rank_group, monkeypatch):
    """A late upload of a failed group's persist must never land on a file a newer save wrote:
    the newer checkpointer writes nothing until it has ended."""
    import elastic.checkpoint.persister as ckpt
    storage, root = store
    old, done = _still_uploading(storage, root, one_rank_group)
    seen = []
    real = ckpt.save_shards
    monkeypatch.setattr(ckpt, "save_shards", lambda *a, **kw: (seen.append(old.in_flight()), real(*a, **kw))[1])
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2,
                           after=[old], wait_timeout_s=60)
    ck.save(10, 80, model_state(0), {})  # returns at once: the waiting is the persist thread's
    ck.wait(timeout_s=0.5)
    assert ck.in_flight() and seen == [] and storage.list_dir(root) == []
    done.set()
    ck.wait()
    (res,) = ck.drain()
    assert res.committed and seen == [False]


def test_a_persist_is_skipped_while_an_abandoned_upload_outlasts_its_bound(store, one_rank_group, monkeypatch):
    storage, root = store
    saves = count_saves(monkeypatch)
    old, done = _still_uploading(storage, root, one_rank_group)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2,
                           after=[old], wait_timeout_s=0.1)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert not res.committed and res.error.startswith("skipped:") and "abandoned" in res.error
    assert saves == [] and storage.list_dir(root) == []
    done.set()  # it ended: the next checkpoint is written as usual
    ck.save(20, 160, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert res.committed and len(saves) == 1


def test_a_persist_whose_group_failed_during_its_save_is_never_committed(store, one_rank_group, monkeypatch):
    import elastic.checkpoint.persister as ckpt
    storage, root = store
    real = ckpt.save_shards
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=2, backoff_s=0.0, num_to_keep=2)
    monkeypatch.setattr(ckpt, "save_shards", lambda *a, **kw: (ck.abort(), real(*a, **kw))[1])
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert not res.committed and res.error.startswith("abandoned:")
    assert latest_committed(storage, root) is None


def _hung_upload(monkeypatch, cuttable: bool = True) -> threading.Event:
    """Every shard save hangs in its upload: until the persist is stopped (its upload cut short:
    UploadCut) or, `cuttable` False, until the returned event is set (a call nothing can cut)."""
    import elastic.checkpoint.persister as ckpt
    from elastic.checkpoint.uploader import UploadCut
    release = threading.Event()

    def hang(*a, cancel=None, **kw):
        while not release.wait(0.02):
            if cuttable and cancel is not None and cancel.is_set():
                raise UploadCut("upload cut short")
        raise ConnectionError("released")
    monkeypatch.setattr(ckpt, "save_shards", hang)
    return release


@pytest.mark.timeout(60)
def test_a_persist_past_its_bound_is_given_up_reported_timed_out_and_owed(store, one_rank_group, monkeypatch):
    """A persist whose upload hangs (rather than fails) used to be waited for forever."""
    from elastic.checkpoint.retry import owes_retry
    storage, root = store
    release = _hung_upload(monkeypatch)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=2, backoff_s=0.0, num_to_keep=2,
                           persist_timeout_s=0.3)
    ck.save(10, 80, model_state(0), {})
    assert not ck.expire() and ck.in_flight()  # within its bound: left alone
    ck.wait_within_bound(grace_s=30)
    assert not ck.in_flight() and not ck.aborted()  # the group goes on
    (res,) = ck.drain()
    assert not res.committed and res.error.startswith("timed out:")
    assert "checkpoint.persist_timeout_s=0.3" in res.error and "step_000000010" in res.error
    assert owes_retry(res.error)  # a storage failure: the checkpoint is saved again
    assert latest_committed(storage, root) is None
    release.set()
    monkeypatch.undo()  # storage answers again: the next persist of this checkpointer commits
    ck.save(20, 160, model_state(0), {})
    ck.wait_within_bound(grace_s=30)
    (res,) = ck.drain()
    assert res.committed, res.error


@pytest.mark.timeout(60)
def test_a_persist_that_cannot_be_cut_is_left_running_past_its_bound(store, one_rank_group, monkeypatch):
    storage, root = store
    release = _hung_upload(monkeypatch, cuttable=False)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2,
                           persist_timeout_s=0.2)
    ck.save(10, 80, model_state(0), {})
    ck.wait_within_bound(grace_s=0.2)  # returns, bounded, though the persist goes on
    assert ck.in_flight() and ck.expire()
    release.set()
    ck.wait()
    (res,) = ck.drain()
    assert not res.committed and res.error.startswith("timed out:") and "released" in res.error


def test_a_worker_fenced_during_its_save_never_commits(store, one_rank_group):
    storage, root = store
    answers = iter([True])  # may write when the save starts; a newer generation took over since

    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=2, backoff_s=0.0, num_to_keep=2,
                           may_write=lambda: next(answers, False))
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert not res.committed and res.error.startswith("fenced:")
    names = storage.sizes(step_dir(root, 10))
    assert "__0_0.distcp" in names and MANIFEST not in names and COMMIT_MARKER not in names


# ---------------------------------------------------------------- two ranks on gloo, spawned (no Ray)

def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_state(rank, seed):
    torch.manual_seed(seed * 10 + rank)
    return {f"rank{rank}": torch.randn(5)}  # each rank writes its own shard file


def _persist_on_two_ranks(rank, world, port, root, out_dir):
    import elastic.checkpoint.persister as ckpt
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    # A short backstop: without lockstep, a rank left alone in a collective fails instead of hanging the test.
    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=5))
    saves = []
    real_save = ckpt.save_shards
    ckpt.save_shards = lambda *a, **kw: (saves.append(a[1].rsplit("_", 1)[1]), real_save(*a, **kw))[1]
    storage = Storage(root)
    if rank == 0:  # rank 0's commit of step 10 keeps failing; the shards are fine
        real_write = storage.write_bytes

        def write(uri, data):
            if uri == join(step_dir(root, 10), COMMIT_MARKER):
                raise StorageError(f"write {uri} failed: ConnectionError: injected")
            return real_write(uri, data)
        storage.write_bytes = write
    fenced = {"rank 1": False}
    ck = AsyncCheckpointer(storage, root, rank, world, "ddp", pg, retries=1, backoff_s=0.0, num_to_keep=5,
                           may_write=lambda: not (rank == 1 and fenced["rank 1"]))
    results = []
    for step, seed in [(10, 0), (20, 0), (20, 1), (30, 0)]:
        if step == 30:
            fenced["rank 1"] = True
        ck.save(step, step * 8, _rank_state(rank, seed), {})
        ck.wait()
        (res,) = ck.drain()
        results.append({"step": step, "committed": res.committed, "reused": res.reused, "error": res.error})
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"results": results, "saves": saves}, f)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_take_the_same_path_through_every_persist(tmp_path):
    """Rank 0's failing commit, a redone step and a fence on rank 1 only: every rank makes the same
    collective saves (one per new step), nobody waits alone in a collective, nothing is rewritten."""
    import torch.multiprocessing as mp
    root = f"file://{tmp_path}/run/checkpoints"
    mp.start_processes(_persist_on_two_ranks, args=(2, _free_port(), root, str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    out = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert all(out[r]["saves"] == ["000000010", "000000020"] for r in (0, 1)), out
    r0, r1 = out[0]["results"], out[1]["results"]
    assert [x["committed"] for x in r0] == [False, True, True, False], r0
    assert r0[0]["error"].startswith(f"commit of {step_dir(root, 10)} failed")
    assert r0[2]["reused"] and r1[2]["reused"]
    assert r0[3]["error"].startswith("fenced: 1 rank(s)") and r1[3]["error"].startswith("fenced: rank 1:")
    storage = Storage(root)
    assert [c.step for c in committed_checkpoints(storage, root)] == [20]
    assert not storage.exists(step_dir(root, 10))  # uncommitted and older than step 20: retention took it
    assert not storage.exists(step_dir(root, 30))
    loaded = {"rank0": torch.zeros(5), "rank1": torch.zeros(5)}
    load_shards(loaded, step_dir(root, 20), {}, None)  # the first attempt's state, not the redone one's
    assert all(torch.equal(loaded[f"rank{r}"], _rank_state(r, 0)[f"rank{r}"]) for r in (0, 1))


# ---------------------------------------------------------------- the same on S3 (SeaweedFS)

@pytest.mark.s3
@pytest.mark.timeout(120)
def test_on_s3_a_redone_step_and_a_lost_attempts_leftovers(s3_server, one_rank_group):
    root = f"{s3_server.uri}/ckpt-{uuid.uuid4().hex[:8]}/run/checkpoints"
    storage = Storage(root, s3_server.storage_options)
    # A lost attempt at step 10 left shards of a rank that no longer exists.
    storage.write_bytes(join(step_dir(root, 10), "__5_0.distcp"), b"old" * 10)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=1, backoff_s=0.0, num_to_keep=2,
                           data_order=DATA_ORDER)
    for seed in (0, 1):  # the second save of step 10 is a redone step
        ck.save(10, 80, model_state(seed), {})
        ck.wait()
    first, again = ck.drain()
    assert first.committed and not first.reused and again.committed and again.reused
    latest = latest_committed(storage, root)
    assert sorted(latest.manifest.files) == [".metadata", "__0_0.distcp"]
    assert latest.manifest.data_order == DATA_ORDER
    restored = model_state(2)
    load_shards(restored, latest.uri, s3_server.storage_options, one_rank_group)
    assert torch.equal(restored["model"]["weight"], model_state(0)["model"]["weight"])
    # Emptied by hand (SeaweedFS keeps listing an emptied prefix for a while): saved afresh.
    storage.remove_tree(step_dir(root, 10))
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert res.committed and not res.reused, res.error


def test_snapshot_reuses_the_previous_buffers_and_copies_values():
    import torch
    from elastic.checkpoint.dcp_io import snapshot
    state = {"model": {"w": torch.ones(3, 2)}, "optim": {"state": {"w": {"step": torch.tensor(1.0)}}, "lr": 0.1}}
    first = snapshot(state)
    state["model"]["w"].mul_(5)
    second = snapshot(state, first)
    assert second["model"]["w"] is first["model"]["w"]  # the same memory, new values
    assert torch.equal(second["model"]["w"], torch.full((3, 2), 5.0)) and second["optim"]["lr"] == 0.1
    assert second["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()  # still a private copy
    state["model"]["w"] = torch.ones(4)  # a changed shape gets a fresh buffer
    assert snapshot(state, second)["model"]["w"].shape == (4,)


def test_remote_shards_are_staged_on_local_disk_then_uploaded_and_the_stage_removed(one_rank_group, tmp_path,
                                                                                     monkeypatch):
    import tempfile

    import fsspec

    from elastic.checkpoint.dcp_io import save_shards, written_files
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the stage goes
    folder = f"memory://stage-{uuid.uuid4().hex}/run/checkpoints/step_000000001"
    saved = save_shards(model_state(0), folder, {}, one_rank_group)
    fs, path = fsspec.core.url_to_fs(folder)
    assert {p.rsplit("/", 1)[1] for p in fs.find(path)} == written_files(saved.metadata) == set(saved.digests)
    assert not list(tmp_path.glob("elastic-stage-*"))
    restored = model_state(1)
    load_shards(restored, folder, {}, one_rank_group)
    assert torch.equal(restored["model"]["weight"], model_state(0)["model"]["weight"])

    # A failed upload raises (the persist's retries take it from there) and leaves no stage behind.
    def refuse(*a, **kw):
        raise OSError("upload refused")
    monkeypatch.setattr(type(fs), "put", refuse)
    with pytest.raises(OSError, match="upload refused"):
        save_shards(model_state(0), folder + "x", {}, one_rank_group)
    assert not list(tmp_path.glob("elastic-stage-*"))


@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_a_save_says_when_it_starts_writing_to_storage_and_not_before(one_rank_group, tmp_path, protocol):
    """`on_write` (what a `during_upload` chaos fault waits for) is called once, after the
    collective planning and before any of this rank's files reach the folder."""
    import fsspec

    from elastic.checkpoint.dcp_io import save_shards
    base = f"file://{tmp_path}" if protocol == "file" else f"memory://w-{uuid.uuid4().hex}"
    folder = f"{base}/run/checkpoints/step_000000001"
    fs, path = fsspec.core.url_to_fs(folder)
    seen = []
    save_shards(model_state(0), folder, {}, one_rank_group,
                on_write=lambda: seen.append(fs.exists(path) and bool(fs.find(path))))
    assert seen == [False] and fs.find(path)


def test_a_checkpointer_reports_its_persist_writing(store, one_rank_group):
    storage, root = store
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    assert not ck.writing.is_set()
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    first = ck.writing
    assert first.is_set() and ck.drain()[0].committed
    ck.save(20, 160, model_state(0), {})
    ck.wait()
    assert ck.writing is not first and ck.writing.is_set() and ck.drain()[0].committed  # one event per persist


def test_a_persist_waits_for_its_groups_fence_within_its_bound(store, one_rank_group):
    """The fence of a group formed during an outage lands late: a persist asks again while the
    answer is "not yet" and commits once it lands; past the bound it writes nothing."""
    storage, root = store
    answers = [(None, "not landed"), (None, "not landed"), (True, "")]
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2,
                           may_write=lambda: answers.pop(0) if len(answers) > 1 else answers[0], wait_timeout_s=30)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert res.committed and answers == [(True, "")]
    never = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2,
                              may_write=lambda: (None, "not landed"), wait_timeout_s=0.2)
    never.save(20, 160, model_state(0), {})
    never.wait()
    (res,) = never.drain()
    assert not res.committed and res.error.startswith("fenced: rank 0: not landed")
    assert [c.step for c in committed_checkpoints(storage, root)] == [10]


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_on_s3_an_upload_whose_group_failed_is_cut_short_and_never_committed(s3_server, one_rank_group):
    """A survivor's persist can never commit once its group failed. Its upload is cut short
    (the coroutine on fsspec's loop is cancelled) instead of running on beside the new group: here
    it would take about 40 s through a 200 kB/s link; the persist ends with its upload cut, not
    done (its error says so: only a cut upload raises UploadCut).
    The slow link's relay closes with it; a later checkpoint of the same folder commits whole."""
    from tests.support.slow_link import SlowLink
    host, port = s3_server.endpoint_url.rsplit("/", 1)[1].split(":")
    root = f"{s3_server.uri}/cut-{uuid.uuid4().hex[:8]}/run/checkpoints"
    state = {"model": {"weight": torch.arange(2_000_000, dtype=torch.float32)}}  # 8 MB
    with SlowLink(host, int(port), bytes_per_s=200_000) as link:
        storage = Storage(root, {**s3_server.storage_options, "endpoint_url": link.url})
        ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=2, backoff_s=0.0,
                               num_to_keep=2)
        ck.save(10, 80, state, {})
        assert ck.writing.wait(30)
        time.sleep(1.0)  # well into the upload
        assert ck.cuttable.is_set() and not ck.cut_pending()  # an upload that can be cut, not aborted yet
        ck.abort()
        ck.wait(timeout_s=60)  # a backstop past the 40 s an uncut upload would take
        assert not ck.in_flight(), "the abandoned upload ran on"
        assert not ck.cut_pending()  # the cut has landed: nothing to wait for (Worker.leave)
        (res,) = ck.drain()
    assert not res.committed and res.error.startswith("abandoned: the group failed during the upload, cut short")
    storage = Storage(root, s3_server.storage_options)
    assert latest_committed(storage, root) is None
    again = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=2, backoff_s=0.0, num_to_keep=2)
    again.save(10, 80, state, {})
    again.wait()
    (res,) = again.drain()
    assert res.committed, res.error
    restored = {"model": {"weight": torch.zeros(2_000_000)}}
    load_shards(restored, latest_committed(storage, root).uri, s3_server.storage_options, one_rank_group)
    assert torch.equal(restored["model"]["weight"], state["model"]["weight"])


def test_an_upload_on_a_synchronous_filesystem_is_not_cut_and_one_not_cancelled_completes(tmp_path):
    import fsspec

    from elastic.checkpoint.dcp_io import upload
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(b"x" * 10)
    cancel = threading.Event()
    cancel.set()
    mem = fsspec.filesystem("memory")
    dst = f"/up-{uuid.uuid4().hex}/"
    cuttable = threading.Event()
    upload(mem, f"{tmp_path}/src/", dst, cancel, on_cuttable=cuttable.set)  # synchronous: uploads to the end
    assert mem.cat(dst + "a") == b"x" * 10
    assert not cuttable.is_set()  # never said to be cuttable: Worker.leave does not wait for a cut


def test_a_dcp_failure_is_described_by_each_ranks_own_error_not_its_tracebacks():
    """DCP's CheckpointException prints every rank's traceback, the cause last: cut at 300
    characters, the reason of a failed load said nothing ("CheckpointException ranks: ...")."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from elastic.checkpoint.retry import describe_failure
    stack = traceback.StackSummary.from_list([("dcp.py", 1, "load", "x")] * 20)
    size = ValueError("Size mismatch between saved torch.Size([64, 256]) and current: torch.Size([128, 256])")
    e = CheckpointException("load", {0: (size, stack), 1: (size, stack), 2: (OSError("connection reset"), stack)})
    assert describe_failure(e) == ("ranks 0,1: ValueError: Size mismatch between saved torch.Size([64, 256]) and "
                                   "current: torch.Size([128, 256]); rank 2: OSError: connection reset")
    assert describe_failure(RuntimeError("x" * 500)) == "RuntimeError: " + "x" * 286


def test_a_failed_checkpoint_is_owed_only_for_storage_and_retried_at_a_doubling_pace():
    from elastic.checkpoint.retry import RETRY_WAIT_MAX_S, owes_retry, retry_wait_s
    assert owes_retry("ConnectionError: storage unavailable (injected)")
    assert owes_retry("commit of s3://b/run/checkpoints/step_000000005 failed after 6 attempt(s): ...")
    for given_up in ("abandoned: the group failed during the save; never committed",
                     "fenced: rank 0: the run has moved on to generation 3", "skipped: 1 rank(s) still upload"):
        assert not owes_retry(given_up)
    assert [retry_wait_s(1.0, k) for k in range(8)] == [1, 2, 4, 8, 16, 32, RETRY_WAIT_MAX_S, RETRY_WAIT_MAX_S]


def test_prestaged_buffers_take_the_first_snapshot_and_pass_to_the_next_checkpointer(store, one_rank_group):
    """The first checkpoint copies into buffers made ahead in the background (no fresh memory
    faulted in on the training thread); a later group's checkpointer starts from them."""
    from elastic.checkpoint.dcp_io import staging_for
    storage, root = store
    state = model_state(0)
    state["optim"] = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3, 4)}}, "lr": 0.1}
    made = staging_for(state)
    assert made["optim"]["lr"] is None and made["model"]["weight"].shape == (3, 4)
    assert torch.count_nonzero(made["model"]["weight"]) == 0  # touched (zeroed), not copied from state

    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    assert ck.needs_staging()
    ck.prestage(state)
    assert not ck.needs_staging()
    ck.prestage(state)  # once: a second call makes nothing
    ck._prestage.join()
    buffers = ck.spare_buffers()
    weight = buffers["model"]["weight"]
    ck.save(10, 80, state, {})
    ck.wait()
    (res,) = ck.drain()
    assert res.committed
    assert ck._staged["model"]["weight"] is weight  # the snapshot went into the prestaged buffer
    assert torch.equal(weight, state["model"]["weight"])
    back = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    load_shards(back, step_dir(root, 10), storage.options, one_rank_group)
    assert torch.equal(back["model"]["weight"], state["model"]["weight"])

    nxt = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2,
                            staged=ck.spare_buffers())
    assert not nxt.needs_staging()
    state["model"]["weight"].add_(1.0)
    nxt.save(20, 160, state, {})
    nxt.wait()
    assert nxt._staged["model"]["weight"] is weight and torch.equal(weight, state["model"]["weight"])


def test_a_checkpointer_with_a_persist_in_flight_gives_no_buffers_away(store, one_rank_group, monkeypatch):
    import elastic.checkpoint.persister as ckpt
    storage, root = store
    release = threading.Event()
    real_save = ckpt.save_shards
    monkeypatch.setattr(ckpt, "save_shards", lambda *a, **k: (release.wait(30), real_save(*a, **k))[1])
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    assert ck.in_flight() and ck.spare_buffers() is None  # its persist still reads the snapshot
    release.set()
    ck.wait()
    assert ck.spare_buffers() is ck._staged


# ---------------------------------------------------------------- verified checkpoints: digests in the manifest

def flip_bytes_in_largest_shard(folder: str, num_bytes: int = 64) -> str:
    """Flip `num_bytes` in the middle of the folder's largest shard, in place (size unchanged), as
    bit rot or a same-size overwrite would. Returns the shard's name."""
    import os
    path = folder[len("file://"):] if folder.startswith("file://") else folder
    name = max((n for n in os.listdir(path) if n.endswith(".distcp")), key=lambda n: os.path.getsize(f"{path}/{n}"))
    size = os.path.getsize(f"{path}/{name}")
    with open(f"{path}/{name}", "r+b") as f:
        f.seek(size // 2)
        old = f.read(num_bytes)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in old))
    assert os.path.getsize(f"{path}/{name}") == size
    return name


def test_every_file_of_a_save_has_its_digest_in_the_manifest(tmp_path, one_rank_group):
    import zlib
    root = f"file://{tmp_path}/run/checkpoints"
    storage = Storage(root)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    manifest = latest_committed(storage, root).manifest
    assert set(manifest.digests) == set(manifest.files) == {".metadata", "__0_0.distcp"}
    folder = tmp_path / "run" / "checkpoints" / "step_000000010"
    assert all(manifest.digests[n] == f"crc32:{zlib.crc32((folder / n).read_bytes()):08x}" for n in manifest.files)


def test_a_remote_save_digests_its_staged_files(one_rank_group):
    import zlib
    import fsspec
    from elastic.checkpoint.dcp_io import save_shards
    folder = f"memory://digest-{uuid.uuid4().hex}/run/checkpoints/step_000000001"
    saved = save_shards(model_state(0), folder, {}, one_rank_group)
    fs, path = fsspec.core.url_to_fs(folder)
    assert saved.digests and all(d == f"crc32:{zlib.crc32(fs.cat_file(f'{path}/{n}')):08x}"
                                 for n, d in saved.digests.items())


def test_verification_names_the_file_whose_bytes_changed(tmp_path, one_rank_group):
    from elastic.checkpoint.loading import verify_shards
    from elastic.checkpoint.layout import CorruptCheckpoint
    root = f"file://{tmp_path}/run/checkpoints"
    ck = AsyncCheckpointer(Storage(root), root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    folder = step_dir(root, 10)
    verify_shards(folder, {}, one_rank_group)  # intact
    name = flip_bytes_in_largest_shard(folder)
    assert latest_committed(Storage(root), root).uri == folder  # sizes alone cannot tell
    with pytest.raises(CorruptCheckpoint, match=f"digest mismatch in step_000000010/{name}: crc32:"):
        verify_shards(folder, {}, one_rank_group)


def test_the_files_are_shared_out_by_size_each_to_one_rank():
    from elastic.checkpoint.loading import share_of
    files = {"a": 100, "b": 60, "c": 50, "d": 10, ".metadata": 5}
    m = Manifest(1, 8, 2, "ddp", files, 0.0, digests={n: "crc32:00000000" for n in files if n != "d"})
    shares = [share_of(m, r, 2) for r in range(2)]
    assert shares == [["a", ".metadata"], ["b", "c"]]  # "d" has no digest: not read
    assert share_of(m, 0, 1) == ["a", "b", "c", ".metadata"]


def test_retention_keeps_the_newest_that_verify_not_a_newer_corrupt_one(tmp_path, one_rank_group):
    """A restore fell back past step 20, whose shard changed after its commit; the run commits
    step 15 again. Retention used to count step 20 as the one to keep and remove 15 and 10,
    every checkpoint that loads. A process that knows nothing of them reads each once."""
    from elastic.checkpoint.layout import Verdicts
    root = f"file://{tmp_path}/run/checkpoints"
    storage = Storage(root)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=5)
    for step in (10, 20, 15):
        ck.save(step, step * 8, model_state(step), {})
        ck.wait()
        if step == 20:
            flip_bytes_in_largest_shard(step_dir(root, 20))
    removed = apply_retention(storage, root, num_to_keep=1, verdicts=Verdicts())
    assert removed == [step_dir(root, 10)]
    assert [c.step for c in committed_checkpoints(storage, root)] == [20, 15]  # the newest committed stays


def test_retention_keeps_what_a_rollback_goes_back_to(store):
    """train.bad_step=rollback, bad_step_limit=3, a checkpoint every step, num_to_keep=1: a
    rollback after bad steps 11-13 goes back to step 10, which the commits of 11 and 12 used to
    remove."""
    storage, root = store
    for s in (9, 10, 11, 12):
        fake_checkpoint(storage, root, s)
    removed = apply_retention(storage, root, num_to_keep=1, rollback_window=2)
    assert [c.step for c in committed_checkpoints(storage, root)] == [12, 10]
    assert removed == [step_dir(root, 9), step_dir(root, 11)]
    assert apply_retention(storage, root, num_to_keep=1) == [step_dir(root, 10)]  # no rollback: as before


def test_a_redone_step_does_not_report_a_commit_its_restore_found_corrupt(tmp_path, one_rank_group):
    from elastic.checkpoint.loading import verify_shards
    from elastic.checkpoint.layout import CorruptCheckpoint
    root = f"file://{tmp_path}/run/checkpoints"
    storage = Storage(root)
    first = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    first.save(10, 80, model_state(0), {})
    first.wait()
    flip_bytes_in_largest_shard(step_dir(root, 10))
    with pytest.raises(CorruptCheckpoint):  # the restore skipped it
        verify_shards(step_dir(root, 10), {}, one_rank_group)
    again = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0, backoff_s=0.0, num_to_keep=2)
    again.save(10, 80, model_state(0), {})
    again.wait()
    (res,) = again.drain()
    assert not res.committed and "digest mismatch in step_000000010/" in res.error, res


def _verify_on_two_ranks(rank, world, port, folder, out_dir):
    import elastic.checkpoint.dcp_io as dcp_io
    from elastic.checkpoint import layout, loading
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=10))
    dcp_io.save_shards(_rank_state(rank, 0), folder, {}, pg)
    read = []
    real = layout.check_files
    loading.check_files = lambda f, o, m, names: (read.extend(names), real(f, o, m, names))[1]
    results = []
    for _ in range(2):  # intact, then with a flipped shard
        try:
            loading.verify_shards(folder, {}, pg)
            results.append(None)
        except Exception as e:  # noqa: BLE001
            results.append(f"{type(e).__name__}: {e}")
        dist.barrier(group=pg)
        if rank == 0 and len(results) == 1:
            flip_bytes_in_largest_shard(folder, 8)
        dist.barrier(group=pg)
    with open(f"{out_dir}/verify{rank}.json", "w") as f:
        json.dump({"results": results, "read": read}, f)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_each_verify_a_share_and_agree_on_the_verdict(tmp_path):
    """Every file is read once across the group, and a mismatch in one rank's share makes both
    ranks raise the same error (so both move to the same next candidate)."""
    import torch.multiprocessing as mp
    folder = f"file://{tmp_path}/run/checkpoints/step_000000010"
    # A manifest, as rank 0's commit writes it, from what the save wrote.
    mp.start_processes(_save_manifest_then_verify, args=(2, _free_port(), folder, str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    out = {r: json.loads((tmp_path / f"verify{r}.json").read_text()) for r in (0, 1)}
    reads = out[0]["read"] + out[1]["read"]
    names = sorted(Manifest.from_json((tmp_path / "run/checkpoints/step_000000010" / MANIFEST).read_bytes()).digests)
    assert sorted(reads) == sorted(names * 2) and out[0]["read"] and out[1]["read"]  # twice: two verifications
    assert out[0]["results"][0] is None and out[1]["results"][0] is None
    assert out[0]["results"][1] == out[1]["results"][1]
    assert out[0]["results"][1].startswith("CorruptCheckpoint: digest mismatch in step_000000010/__")


def _save_manifest_then_verify(rank, world, port, folder, out_dir):
    import elastic.checkpoint.dcp_io as dcp_io
    real_save = dcp_io.save_shards

    def save_and_commit(state, folder_, options, pg):
        saved = real_save(state, folder_, options, pg)
        if rank == 0:
            files = {n: s for n, s in Storage(folder_).sizes(folder_).items()}
            commit(Storage(folder_), folder_, Manifest(10, 80, world, "ddp", files, 0.0, digests=saved.digests))
        dist.barrier(group=pg)
        return saved
    dcp_io.save_shards = save_and_commit
    _verify_on_two_ranks(rank, world, port, folder, out_dir)


# ---------------------------------------------------------------- verified checkpoints through a worker's restore

def _one_worker(tmp_path, num_to_keep, storage_uri=None):
    """A worker outside Ray, in this process, checkpointing every 5 steps to `storage_uri` (by
    default file:// in `tmp_path`; memory:// works too, the worker being this process)."""
    from elastic.checkpoint.layout import checkpoints_root
    from elastic.config import JobConfig
    from elastic.runtime.worker import Worker
    storage_uri = storage_uri or f"file://{tmp_path}"
    job = JobConfig.model_validate({
        "run": {"name": "w", "num_steps": 20, "seed": 1},
        "scaling": {"num_workers": 1},
        "checkpoint": {"storage_uri": storage_uri, "every_steps": 5, "num_to_keep": num_to_keep},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": 8},
    })
    w = Worker(job.model_dump_json(), checkpoints_root(storage_uri, "w"))

    def join(generation):
        from elastic.checkpoint.fencing import write_fence
        write_fence(Storage(w.root), w.root, generation)  # as the controller does before a group forms
        w.join("127.0.0.1", rendezvous_port(), 0, 1, generation=generation)
    return w, join


def _state_copy(w):
    from elastic.runtime import state
    flat = {}

    def walk(prefix, x):
        if isinstance(x, torch.Tensor):
            flat[prefix] = x.detach().clone()
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}/{i}", v)
        else:
            flat[prefix] = x
    walk("", state.state_dict(w))
    return flat


def _same(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.mark.timeout(120)
def test_a_restore_skips_a_checkpoint_whose_bytes_changed_and_loads_the_previous_bit_exact(tmp_path):
    """64 bytes flipped in the middle of the newest checkpoint's largest shard (size unchanged):
    the restore used to load it without a word. Now it is skipped with a reason naming the file,
    the previous one loads bit for bit, and retention after that fallback keeps what loads."""
    w, join = _one_worker(tmp_path, num_to_keep=2)
    join(1)
    w.restore([])
    try:
        assert w.run(5, []).status == "done"
        at_5 = _state_copy(w)
        assert w.run(10, []).status == "done"
        w.ckpt.wait()
        storage = Storage(w.root)
        found = committed_checkpoints(storage, w.root)
        assert [c.step for c in found] == [10, 5]
        name = flip_bytes_in_largest_shard(found[0].uri)
        assert [c.step for c in committed_checkpoints(storage, w.root)] == [10, 5]  # sizes alone pass it

        join(2)
        out = w.restore([c.uri for c in found])
        assert out.source == "storage" and out.uri == found[1].uri and out.step == 5
        assert [u for u, _ in out.skipped] == [found[0].uri]
        assert f"digest mismatch in step_000000010/{name}" in out.skipped[0][1], out.skipped
        assert _same(_state_copy(w), at_5)

        # A checkpoint below the unloadable one (the end of a run, a retried save), checkpoint.
        # num_to_keep=1: retention used to keep step 10 as "the newest" and remove step 7 and
        # step 5, every one that loads.
        w.ckpt.num_to_keep = 1
        assert w.run(7, []).status == "done"
        w.ckpt.wait()
        (res,) = [p for p in w.poll().persists if p.step == 7]
        assert res.committed, res
        assert [c.step for c in committed_checkpoints(storage, w.root)] == [10, 7]
        join(3)
        out = w.restore([c.uri for c in committed_checkpoints(storage, w.root)])
        assert out.uri == step_dir(w.root, 7) and out.step == 7
    finally:
        w.leave()


@pytest.mark.timeout(120)
def test_a_checkpoint_whose_manifest_has_no_digests_still_loads(tmp_path):
    """Written before digests were recorded: checked by size only, and loaded."""
    w, join = _one_worker(tmp_path, num_to_keep=2)
    join(1)
    w.restore([])
    try:
        assert w.run(5, []).status == "done"
        w.ckpt.wait()
        at_5 = _state_copy(w)
        storage = Storage(w.root)
        folder = step_dir(w.root, 5)
        raw = json.loads(storage.read_bytes(join_(folder, MANIFEST)))
        assert raw.pop("digests")
        storage.write_bytes(join_(folder, MANIFEST), json.dumps(raw).encode())
        join(2)
        out = w.restore([c.uri for c in committed_checkpoints(storage, w.root)])
        assert out.uri == folder and out.step == 5 and out.skipped == ()
        assert _same(_state_copy(w), at_5)
    finally:
        w.leave()


join_ = join


def test_shard_snapshots_reuse_their_buffers_and_restore_bit_exact(one_rank_group, tmp_path):
    """FSDP's state is DTensors: a checkpoint's snapshot copies into the last one's shards
    rather than allocating a second copy beside it, and what it saves loads back bit for bit.
    None are made ahead (`staging_for`): they would be held from the start, long before the
    first checkpoint (tests/test_meta_init.py's memory cap)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from elastic.checkpoint.dcp_io import save_shards, snapshot, staging_for
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    live = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    state = {"model": {"w": live}, "optim": {"state": {"w": {"exp_avg": live * 3, "step": torch.tensor(2.0)}}}}
    prestaged = staging_for(state)
    assert prestaged["model"]["w"] is None and prestaged["optim"]["state"]["w"]["exp_avg"] is None
    first = snapshot(state, prestaged)
    assert first["model"]["w"].to_local().data_ptr() != live.to_local().data_ptr()
    live.to_local().mul_(0.5)  # training goes on
    second = snapshot(state, first)
    assert second["model"]["w"].to_local().data_ptr() == first["model"]["w"].to_local().data_ptr()
    assert second["model"]["w"].to_local().data_ptr() != live.to_local().data_ptr()  # still a private copy
    assert torch.equal(second["model"]["w"].to_local(), live.to_local())
    assert second["model"]["w"].placements == live.placements and second["model"]["w"].shape == live.shape
    save_shards(second, f"file://{tmp_path}/ckpt", {}, None)
    back = {"model": {"w": distribute_tensor(torch.full((6, 4), float("nan")), mesh, [Shard(0)])},
            "optim": {"state": {"w": {"exp_avg": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]),
                                      "step": torch.tensor(0.0)}}}}
    dcp.load(back, checkpoint_id=str(tmp_path / "ckpt"))
    assert torch.equal(back["model"]["w"].to_local(), live.to_local())
    saved_avg = state["optim"]["state"]["w"]["exp_avg"].to_local()
    assert torch.equal(back["optim"]["state"]["w"]["exp_avg"].to_local(), saved_avg)
    assert back["optim"]["state"]["w"]["step"].item() == 2.0
