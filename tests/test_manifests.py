"""What a reader makes of a checkpoint folder it finds in storage (elastic/checkpoint/layout.py):
a manifest parsed strictly, its step checked against the folder's name and COMMITTED, and one
bad folder skipped alone, with a reason, by every reader: the listing, the controller's restore
and the driver's resume check. On memory://, with the controller against a fake group."""
from __future__ import annotations

import json
import logging
import uuid

import pytest

from elastic.checkpoint.layout import (COMMIT_MARKER, MANIFEST, Manifest, commit,
                                       committed_checkpoints, latest_committed, step_dir)
from elastic.controller.states import Finished
from elastic.storage import Storage, StorageError, join
from tests.test_controller import _release_leases, drive, kinds, make  # noqa: F401 (autouse)

pytestmark = pytest.mark.timeout(60)

ORDER = {"global_batch_size": 48, "seed": 7, "num_samples": 100}


@pytest.fixture
def store():
    root = f"memory://manifests-{uuid.uuid4().hex}/run/checkpoints"
    return Storage(root), root


def checkpoint(storage: Storage, root: str, step: int, data_order: dict | None = None,
               raw: dict | None = None) -> str:
    """A committed checkpoint of `step`; `raw` replaces fields of its manifest as written."""
    folder = step_dir(root, step)
    storage.write_bytes(join(folder, "__0_0.distcp"), b"x" * 100)
    commit(storage, folder, Manifest(step, step * 48, 1, "ddp", {"__0_0.distcp": 100}, 0.0,
                                     data_order=dict(ORDER if data_order is None else data_order)))
    if raw:
        manifest = json.loads(storage.read_bytes(join(folder, MANIFEST)))
        storage.write_bytes(join(folder, MANIFEST), json.dumps({**manifest, **raw}).encode())
    return folder


@pytest.mark.parametrize("raw,why", [
    ({"files": None}, "manifest field 'files' is null: expected a map of file name to size in"),
    ({"files": ["__0_0.distcp"]}, "manifest field 'files' is [\"__0_0.distcp\"]: expected a map"),
    ({"step": "20"}, "manifest field 'step' is \"20\": expected a step (an integer >= 0)"),
    ({"cursor": True}, "manifest field 'cursor' is true: expected a data cursor"),
    ({"digests": None}, "manifest field 'digests' is null: expected a map of file name to digest"),
    ({"skip_steps": ["13"]}, "manifest field 'skip_steps' is [\"13\"]: expected a list of steps"),
    ({"step": 30}, "the manifest says step 30, the folder's name step 20"),
])
def test_a_malformed_manifest_skips_its_folder_and_the_older_one_is_listed(store, raw, why):
    """`files: null` used to abort the whole listing (AttributeError outside validate's try), and
    a string step or one that disagrees with the folder's name was listed as a checkpoint."""
    storage, root = store
    checkpoint(storage, root, 10)
    bad = checkpoint(storage, root, 20, raw=raw)
    skipped = []
    found = committed_checkpoints(storage, root, lambda uri, reason: skipped.append((uri, reason)))
    assert [c.step for c in found] == [10]
    assert len(skipped) == 1 and skipped[0][0] == bad and skipped[0][1].startswith(why), skipped


@pytest.mark.parametrize("marker,why", [
    (b"30", "COMMITTED says step 30, the manifest step 20"),
    (b"twenty", "COMMITTED holds b'twenty', not a step"),
])
def test_a_commit_marker_that_names_another_step_skips_its_folder(store, marker, why):
    storage, root = store
    checkpoint(storage, root, 10)
    bad = checkpoint(storage, root, 20)
    storage.write_bytes(join(bad, COMMIT_MARKER), marker)
    skipped = []
    latest = latest_committed(storage, root, lambda uri, reason: skipped.append((uri, reason)))
    assert latest.step == 10
    assert skipped == [(bad, why)]


def test_storage_not_answering_for_a_manifest_is_no_verdict_on_the_folder(store, monkeypatch):
    """A failed read of the newest manifest used to skip that checkpoint as "manifest unreadable":
    a restore then loaded an older one, and retention removed a committed folder as a leftover.
    It is storage not answering: raised, so the caller waits; a manifest that is not there is an
    answer, and skips its folder."""
    storage, root = store
    checkpoint(storage, root, 10)
    newest = checkpoint(storage, root, 20)
    real = storage.read_bytes

    def blip(uri):
        if uri == join(newest, MANIFEST):
            raise StorageError(f"read {uri} failed: ConnectionError: storage unavailable")
        return real(uri)

    monkeypatch.setattr(storage, "read_bytes", blip)
    with pytest.raises(StorageError, match="storage unavailable"):
        committed_checkpoints(storage, root)
    monkeypatch.setattr(storage, "read_bytes", real)
    storage.remove(join(newest, MANIFEST))
    skipped = []
    found = committed_checkpoints(storage, root, lambda u, r: skipped.append(r))
    assert [c.step for c in found] == [10]
    assert skipped == ["manifest.json is not there (removed while listing?)"]


def test_the_controller_restores_the_older_checkpoint_past_a_malformed_one():
    """The controller took the aborted listing for storage not answering: it waited
    checkpoint.restore_wait_s and failed the run, though step 10 loads."""
    c, g, clock = make(num_steps=20, checkpoint={"restore_wait_s": 30})
    checkpoint(c.storage, c.root, 10)
    bad = checkpoint(c.storage, c.root, 15, raw={"files": None})
    drive(c)
    assert not kinds(c, "storage_unanswered")
    assert [(e["step"], e["uri"]) for e in kinds(c, "restored")][:1] == [(10, step_dir(c.root, 10))]
    skipped = [(e["uri"], e["reason"]) for e in kinds(c, "checkpoint_skipped")]
    assert skipped and all(uri == bad and "'files' is null" in why for uri, why in skipped), skipped
    assert isinstance(c.state, Finished) and c.step == 20


def resume_job(storage_uri: str, **train):
    from elastic.config import JobConfig
    return JobConfig.model_validate({
        "run": {"name": "run", "num_steps": 40, "seed": ORDER["seed"]},
        "checkpoint": {"storage_uri": storage_uri},
        "train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 48,
                  **train},
    })


def test_the_resume_check_skips_a_malformed_manifest_and_says_so(store, caplog):
    """The driver crashed with AttributeError ('NoneType' object has no attribute 'items'): it
    caught only StorageError."""
    from elastic.trainer import _check_resume
    storage, root = store
    checkpoint(storage, root, 10)
    bad = checkpoint(storage, root, 20, raw={"files": None})
    base = Storage(root.removesuffix("/run/checkpoints"))
    with caplog.at_level(logging.WARNING, logger="elastic.trainer"):
        _check_resume(base, resume_job(base.uri), ORDER["num_samples"])
    warned = [r.getMessage() for r in caplog.records if bad in r.getMessage()]
    assert warned and all("'files' is null" in m for m in warned), caplog.text
