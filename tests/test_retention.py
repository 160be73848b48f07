"""Retention after a commit (elastic/checkpoint/retention.py): the fence asked before every object
it removes, COMMITTED first, and never the last checkpoint read back from storage removed before
a newer one was read back. On memory://, through the persister of a one-rank gloo group."""
from __future__ import annotations

import uuid

import fsspec
import pytest

from elastic.checkpoint import layout
from elastic.checkpoint.layout import (COMMIT_MARKER, MANIFEST, VERDICTS, commit,
                                       committed_checkpoints, step_dir)
from elastic.checkpoint.persister import AsyncCheckpointer
from elastic.checkpoint.retention import apply_retention
from elastic.storage import Storage, StorageError, join
from tests.test_checkpoint import fake_checkpoint, model_state, one_rank_group  # noqa: F401

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store():
    root = f"memory://retention-{uuid.uuid4().hex}/run/checkpoints"
    return Storage(root), root


def every_file(root: str) -> set[str]:
    fs, path = fsspec.core.url_to_fs(root)
    return {p.removeprefix(path.rstrip("/") + "/") for p in fs.find(path)}


def persister(storage, root, num_to_keep, group, may_write=None) -> AsyncCheckpointer:
    return AsyncCheckpointer(storage, root, 0, 1, "ddp", group, retries=0, backoff_s=0.0,
                             num_to_keep=num_to_keep, may_write=may_write)


def test_a_driver_frozen_after_the_fence_check_removes_one_object_at_most(store, one_rank_group,
                                                                           monkeypatch):
    """The fence was asked once before retention, which then removed whole folders in a loop: a
    driver frozen right after that check, and thawed after another driver took the run over,
    removed every old checkpoint of the new holder's run. Asked before each object now, it removes
    the one it was about to remove (step 10's marker) and stops."""
    storage, root = store
    for s in (10, 20):
        fake_checkpoint(storage, root, s)
    holds = [True]

    def fence():
        return (True, "") if holds[0] else (False, "the run has moved on to generation 1000001")

    for name in ("remove", "remove_tree"):
        real = getattr(storage, name)

        def taken_over(uri, real=real):
            real(uri)
            holds[0] = False  # frozen here; another driver takes the run over meanwhile
        monkeypatch.setattr(storage, name, taken_over)
    before = every_file(root)
    ck = persister(storage, root, 1, one_rank_group, may_write=fence)
    ck.save(30, 240, model_state(0), {})
    ck.wait()
    (res,) = ck.drain()
    assert res.committed, res
    gone = before - every_file(root)
    assert gone == {f"step_000000010/{COMMIT_MARKER}"}, gone
    assert [c.step for c in committed_checkpoints(storage, root)] == [30, 20]


def corrupt_in_storage(folder: str) -> str:
    """Flip bytes of the folder's largest shard in storage, size unchanged: an upload that landed
    other bytes than were staged and digested."""
    fs, path = fsspec.core.url_to_fs(folder)
    shards = [p for p in fs.ls(path, detail=True) if p["name"].endswith(".distcp")]
    name = max(shards, key=lambda p: p["size"])["name"]
    data = bytearray(fs.cat_file(name))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(name, bytes(data))
    return name.rsplit("/", 1)[1]


def test_the_last_checkpoint_read_back_stays_until_a_newer_one_reads_back(store, one_rank_group,
                                                                           monkeypatch):
    """num_to_keep: 1. A commit counted its own folder verified from its local digests, so
    retention removed step 10, read back and intact, before step 20 was ever read from storage,
    and step 20's bytes in storage were not the ones digested: no checkpoint left that loads."""
    import elastic.checkpoint.persister as persister_module
    storage, root = store
    ck = persister(storage, root, 1, one_rank_group)
    ck.save(10, 80, model_state(10), {})
    ck.wait()
    real_commit = persister_module.commit

    def commit_then_corrupt(storage_, folder, manifest):
        real_commit(storage_, folder, manifest)
        if manifest.step == 20:
            corrupt_in_storage(folder)
    monkeypatch.setattr(persister_module, "commit", commit_then_corrupt)
    ck.save(20, 160, model_state(20), {})
    ck.wait()
    assert [c.step for c in committed_checkpoints(storage, root)] == [20, 10]
    found = committed_checkpoints(storage, root)
    _, problem = VERDICTS.known(found[0].uri, found[0].manifest)
    assert problem and "digest mismatch in step_000000020/" in problem
    assert VERDICTS.read_back(found[1].uri, found[1].manifest)

    ck.save(30, 240, model_state(30), {})  # intact: read back, so both older ones go
    ck.wait()
    assert [c.step for c in committed_checkpoints(storage, root)] == [30]
    assert all(p.committed for p in ck.drain())


def test_a_checkpoint_is_read_back_once_every_num_to_keep_commits(store, one_rank_group,
                                                                   monkeypatch):
    """What reading back costs: one full read of the newest kept checkpoint when the last one
    read back leaves the kept window, not one per commit (num_to_keep: 2)."""
    storage, root = store
    read = []
    real = layout.check_files
    monkeypatch.setattr(layout, "check_files",
                        lambda uri, *a: (read.append(layout.step_of_uri(uri)), real(uri, *a))[1])
    ck = persister(storage, root, 2, one_rank_group)
    for step in (10, 20, 30, 40, 50):
        ck.save(step, step * 8, model_state(step), {})
        ck.wait()
    assert read == [10, 30, 50]
    assert [c.step for c in committed_checkpoints(storage, root)] == [50, 40]


def test_a_committed_folder_whose_manifest_read_fails_is_never_removed(store, monkeypatch):
    """The listing skipped a folder whose manifest read failed (a storage blip) as unreadable, and
    retention then removed that committed checkpoint as an abandoned partial folder."""
    storage, root = store
    for s in (10, 20, 30):
        fake_checkpoint(storage, root, s)
    real = storage.read_bytes

    def blip(uri):
        if uri == join(step_dir(root, 20), MANIFEST):
            raise StorageError(f"read {uri} failed: ClientError: 503 Slow Down")
        return real(uri)

    monkeypatch.setattr(storage, "read_bytes", blip)
    with pytest.raises(StorageError, match="503"):
        apply_retention(storage, root, num_to_keep=3)
    monkeypatch.setattr(storage, "read_bytes", real)
    assert [c.step for c in committed_checkpoints(storage, root)] == [30, 20, 10]


def test_without_a_fence_answer_retention_removes_nothing(store):
    storage, root = store
    for s in (10, 20, 30):
        fake_checkpoint(storage, root, s)
    before = every_file(root)
    answers = [(None, "the fence cannot be read: ConnectionError"), False, RuntimeError("boom")]
    for answer in answers:
        def fence(answer=answer):
            if isinstance(answer, Exception):
                raise answer
            return answer
        assert apply_retention(storage, root, num_to_keep=1, may_delete=fence) == []
    assert every_file(root) == before
    removed = apply_retention(storage, root, 1, may_delete=lambda: (True, ""))
    assert removed == [step_dir(root, 10), step_dir(root, 20)]


def test_a_commit_notes_its_folder_verified_but_not_read_back(store):
    storage, root = store
    folder = fake_checkpoint(storage, root, 10)
    (c,) = committed_checkpoints(storage, root)
    assert VERDICTS.known(folder, c.manifest) == (True, None)
    assert not VERDICTS.read_back(folder, c.manifest)
    commit(storage, folder, c.manifest)  # a commit's word never takes back a read-back verdict
    VERDICTS.note(folder, c.manifest, None)
    commit(storage, folder, c.manifest)
    assert VERDICTS.read_back(folder, c.manifest)
