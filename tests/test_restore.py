"""A restore from storage loads the bytes it verified (elastic/checkpoint/loading.py, load_shards
with the manifest), takes its step from the verified manifest, and the driver's resume check
covers every checkpoint the restore may fall back to. On memory://, with a worker in this
process (gloo, one rank, no Ray)."""
from __future__ import annotations

import json
import uuid

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from elastic.checkpoint import loading
from elastic.checkpoint.layout import (MANIFEST, VERDICTS, CorruptCheckpoint, committed_checkpoints,
                                       latest_committed, step_dir)
from elastic.checkpoint.persister import AsyncCheckpointer
from elastic.config import ConfigError
from elastic.runtime import restore
from elastic.storage import Storage, StorageError, join
from tests.test_checkpoint import _one_worker, _same, _state_copy, model_state
from tests.test_checkpoint import one_rank_group  # noqa: F401 (a fixture)
from tests.test_manifests import ORDER, checkpoint, resume_job
from tests.test_retention import corrupt_in_storage

pytestmark = pytest.mark.timeout(120)


def memory_uri() -> str:
    return f"memory://restore-{uuid.uuid4().hex}"


def two_checkpoints(w, join):
    """Steps 5 and 10 committed; the state at step 5."""
    join(1)
    w.restore([])
    assert w.run(5, []).status == "done"
    at_5 = _state_copy(w)
    assert w.run(10, []).status == "done"
    w.ckpt.wait()
    found = committed_checkpoints(Storage(w.root), w.root)
    assert [c.step for c in found] == [10, 5]
    return found, at_5


def test_bytes_that_change_after_the_verification_are_never_loaded(tmp_path, monkeypatch):
    """verify_shards and load_shards read storage separately: a shard whose bytes changed between
    the two (a same-size overwrite) was loaded as if verified. The load checks each item it reads
    now: the checkpoint is skipped, naming the file, and the previous one loads bit for bit."""
    w, join = _one_worker(tmp_path, num_to_keep=2, storage_uri=memory_uri())
    try:
        found, at_5 = two_checkpoints(w, join)
        real, changed = restore.verify_shards, []

        def verify_then_change(uri, *a):
            manifest = real(uri, *a)
            if uri == found[0].uri:
                changed.append(corrupt_in_storage(uri))
            return manifest
        monkeypatch.setattr(restore, "verify_shards", verify_then_change)
        join(2)
        out = w.restore([c.uri for c in found])
        assert changed and out.source == "storage" and out.uri == found[1].uri and out.step == 5
        assert [u for u, _ in out.skipped] == [found[0].uri]
        why = out.skipped[0][1]
        assert f"CorruptCheckpoint: digest mismatch in step_000000010/{changed[0]} (item " in why
        assert _same(_state_copy(w), at_5)
        _, problem = VERDICTS.known(found[0].uri, found[0].manifest)
        assert problem and "as loaded" in problem  # retention does not count it either
    finally:
        w.leave()


def test_a_storage_blip_on_commit_marker_after_a_load_is_no_rank_failure(tmp_path, monkeypatch):
    """The step was read from COMMITTED after a good load, outside any retry: one failed GET
    there failed the rank's whole restore. It is the verified manifest's now."""
    w, join = _one_worker(tmp_path, num_to_keep=2, storage_uri=memory_uri())
    try:
        found, _ = two_checkpoints(w, join)
        real = Storage.read_bytes

        def blip(self, uri):
            if uri.endswith("/COMMITTED"):
                raise StorageError(f"read {uri} failed: ClientError: 503 Slow Down")
            return real(self, uri)
        monkeypatch.setattr(Storage, "read_bytes", blip)
        join(2)
        out = w.restore([c.uri for c in found])
        assert out.source == "storage" and out.uri == found[0].uri and out.step == w.step == 10
    finally:
        w.leave()


def test_every_item_of_a_save_has_its_digest_and_the_load_checks_it(one_rank_group):
    storage_uri = memory_uri()
    root = f"{storage_uri}/run/checkpoints"
    ck = AsyncCheckpointer(Storage(root), root, 0, 1, "ddp", one_rank_group, retries=0,
                           backoff_s=0.0, num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    manifest = latest_committed(Storage(root), root).manifest
    shards = [n for n in manifest.files if n.endswith(".distcp")]
    assert shards and set(manifest.item_digests) == set(shards)
    assert all(len(manifest.item_digests[n]) == 2 for n in shards)  # weight and bias
    folder = step_dir(root, 10)
    loading.load_shards(model_state(1), folder, {}, one_rank_group, manifest=manifest)
    corrupt_in_storage(folder)
    with pytest.raises(CheckpointException, match="digest mismatch in step_000000010/__0_0.distcp"):
        loading.load_shards(model_state(1), folder, {}, one_rank_group, manifest=manifest)


def test_a_manifest_without_item_digests_is_checked_file_by_file_as_loaded(one_rank_group):
    """Written before item digests were recorded: each file DCP reads from is read whole, once,
    checked against its file's digest, and loaded from those bytes."""
    root = f"{memory_uri()}/run/checkpoints"
    storage = Storage(root)
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", one_rank_group, retries=0,
                           backoff_s=0.0, num_to_keep=2)
    ck.save(10, 80, model_state(0), {})
    ck.wait()
    folder = step_dir(root, 10)
    raw = json.loads(storage.read_bytes(join(folder, MANIFEST)))
    assert raw.pop("item_digests")
    storage.write_bytes(join(folder, MANIFEST), json.dumps(raw).encode())
    manifest = loading.verify_shards(folder, {}, one_rank_group)
    loaded = model_state(1)
    loading.load_shards(loaded, folder, {}, one_rank_group, manifest=manifest)
    assert all((loaded["model"][k] == v).all() for k, v in model_state(0)["model"].items())
    name = corrupt_in_storage(folder)
    mismatch = f"digest mismatch in step_000000010/{name} as loaded"
    with pytest.raises(CheckpointException, match=mismatch):
        loading.load_shards(model_state(1), folder, {}, one_rank_group, manifest=manifest)
    with pytest.raises(CorruptCheckpoint):
        loading.verify_shards(folder, {}, one_rank_group)


def test_the_resume_check_covers_the_older_checkpoints_a_restore_falls_back_to():
    """Only the newest checkpoint was checked; a restore that skips it (its bytes changed) loads
    the previous one, written with another seed here, and the cursor then pointed into another
    sample order without a word."""
    from elastic.trainer import _check_resume
    base = Storage(memory_uri())
    root = f"{base.uri}/run/checkpoints"
    checkpoint(base, root, 10, {**ORDER, "seed": 8})
    checkpoint(base, root, 20)
    with pytest.raises(ConfigError) as e:
        _check_resume(base, resume_job(base.uri), ORDER["num_samples"])
    assert str(e.value) == ("run.seed=7 but the run's checkpoint step_000000010 (which a restore "
                            "loads if the newer ones do not) was written with 8: the sample order "
                            "would change; use a new run.name or the same value")
