"""The fence (elastic/checkpoint/fencing.py): which generation may write, failing closed when the
fence cannot be read, on every write path of a persist (shards, each uploaded object, commit,
retention) and the controller's; and a fence write that never holds up a group formation while
storage hangs, yet always lands, in order."""
import threading
import time
import uuid

import pytest

from elastic.checkpoint.fencing import (FENCE, Fence, FenceWriter, current_generation, may_write, unreadable,
                                        write_fence)
from elastic.storage import Storage, StorageError, call_within, join


@pytest.fixture
def store():
    root = f"memory://fence-{uuid.uuid4().hex}/run/checkpoints"
    return Storage(root), root


def test_only_the_generation_the_fence_shows_may_write(store):
    storage, root = store
    ok, why = may_write(storage, root, 1)
    assert ok is None and "not written yet" in why and not unreadable(why)  # no fence yet: not now
    write_fence(storage, root, 3)
    assert may_write(storage, root, 3) == (True, "")
    ok, why = may_write(storage, root, 2)
    assert not ok and "moved on to generation 3" in why  # a zombie of an older group
    ok, why = may_write(storage, root, 4)
    assert ok is None and "has not landed" in why  # not yet: its own fence is still being written


class _Hanging:
    """Storage writes that hang until released, or fail while `failing`."""

    def __init__(self, storage, monkeypatch):
        self.release, self.failing, self.calls = threading.Event(), False, []
        real = storage.write_bytes

        def write_bytes(uri, data):
            self.calls.append(int(data))
            if self.failing:
                raise StorageError(f"{uri}: refused")
            self.release.wait()
            real(uri, data)
        monkeypatch.setattr(storage, "write_bytes", write_bytes)


def test_a_fence_lands_before_the_group_forms_when_storage_answers(store):
    storage, root = store
    fence = FenceWriter(storage, root)
    assert fence.announce(1, wait_s=5) and current_generation(storage, root) == 1
    assert fence.announce(2, wait_s=5) and current_generation(storage, root) == 2


def test_a_hanging_storage_holds_the_formation_only_for_the_bound_and_the_newest_fence_lands_last(store, monkeypatch):
    storage, root = store
    write_fence(storage, root, 1)
    hang = _Hanging(storage, monkeypatch)
    fence = FenceWriter(storage, root, backoff_s=0.01)
    assert not fence.announce(2, wait_s=0.2)  # returns although the write still hangs
    assert not fence.announce(3, wait_s=0.2)  # a newer formation while the first write still hangs
    assert current_generation(storage, root) == 1 and fence.written() == 0
    hang.release.set()
    deadline = time.monotonic() + 10
    while fence.written() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert current_generation(storage, root) == 3 and hang.calls == [2, 3]  # in order: never back to 2


def test_a_refused_fence_write_is_retried_until_it_lands(store, monkeypatch):
    storage, root = store
    hang = _Hanging(storage, monkeypatch)
    hang.release.set()
    hang.failing = True
    fence = FenceWriter(storage, root, backoff_s=0.01)
    assert not fence.announce(1, wait_s=0.1)
    assert "refused" in str(fence.last_error) and len(hang.calls) > 1
    hang.failing = False
    assert fence.announce(1, wait_s=5) and current_generation(storage, root) == 1 and fence.last_error is None


def test_call_within_answers_or_gives_up_at_the_bound():
    assert call_within(lambda: 7, 5) == (True, 7, None)
    answered, result, error = call_within(lambda: 1 / 0, 5)
    assert answered and result is None and isinstance(error, ZeroDivisionError)
    release = threading.Event()
    assert call_within(release.wait, 0.1) == (False, None, None)  # returns although the call still hangs
    release.set()


# ---------------------------------------------------------------- failing closed
def _unreadable_fence(storage, root, monkeypatch, how: str, fails: int = 10 ** 6) -> list:
    """The next `fails` reads of the fence fail as `how` says; returns the list of reads made."""
    reads, real = [], storage.list_dir

    def list_dir(uri):
        if uri == join(root, FENCE):
            reads.append(uri)
            if len(reads) <= fails:
                if how == "error":
                    raise StorageError(f"list {uri} failed: ConnectionError: storage unavailable")
                if how == "throttled":  # s3fs gives up on a 503 SlowDown after its own retries
                    raise StorageError(f"list {uri} failed: OSError: [Errno 16] Please reduce your request rate.")
                return [*real(uri), "\x00\x17garbage"]
        return real(uri)
    monkeypatch.setattr(storage, "list_dir", list_dir)
    return reads


@pytest.mark.parametrize("how", ["error", "throttled", "garbage"])
def test_an_unreadable_fence_lets_no_one_write(store, monkeypatch, how):
    """It used to mean "allowed": a failing or throttled GET let a fenced-off worker commit."""
    storage, root = store
    write_fence(storage, root, 3)
    _unreadable_fence(storage, root, monkeypatch, how)
    for generation in (2, 3, 4):
        ok, why = may_write(storage, root, generation)
        assert ok is None and unreadable(why) and "cannot be read" in why
    assert current_generation(storage, root) is None  # the controller's reading, as before
    assert Fence(storage, root, 3)() == may_write(storage, root, 3)
    assert Fence(storage, root, 3).uri == join(root, FENCE)


def test_the_controller_holds_the_run_only_while_the_fence_shows_its_generation(store, monkeypatch):
    storage, root = store
    fence = FenceWriter(storage, root)
    ok, why = fence.holds()
    assert not ok and "no generation" in why
    assert fence.announce(4, wait_s=5) and fence.holds() == (True, "")
    _unreadable_fence(storage, root, monkeypatch, "throttled", fails=1)
    ok, why = fence.holds()
    assert not ok and unreadable(why)
    assert fence.holds() == (True, "")
    write_fence(storage, root, 9)  # another controller formed a newer group
    ok, why = fence.holds()
    assert not ok and "shows generation 9" in why


@pytest.fixture
def one_rank_group():
    from datetime import timedelta

    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def _state(seed: int = 0) -> dict:
    import torch
    torch.manual_seed(seed)
    return {"model": {k: v.detach().clone() for k, v in torch.nn.Linear(4, 3).state_dict().items()}}


def _persist(storage, root, group, step: int, may_write, **kwargs):
    from elastic.checkpoint.persister import AsyncCheckpointer
    options = {"retries": 0, "backoff_s": 0.0, "num_to_keep": 5, **kwargs}
    ck = AsyncCheckpointer(storage, root, 0, 1, "ddp", group, may_write=may_write, **options)
    ck.save(step, step * 8, _state(step), {})
    ck.wait()
    (res,) = ck.drain()
    return res


def _steps(storage, root) -> list[int]:
    from elastic.checkpoint.layout import committed_checkpoints
    return [c.step for c in committed_checkpoints(storage, root)]


def test_a_persist_writes_nothing_while_the_fence_cannot_be_read_and_its_checkpoint_stays_owed(
        store, one_rank_group, monkeypatch):
    from elastic.checkpoint.layout import step_dir
    from elastic.checkpoint.retry import owes_retry
    storage, root = store
    write_fence(storage, root, 1)
    reads = _unreadable_fence(storage, root, monkeypatch, "throttled")
    res = _persist(storage, root, one_rank_group, 10, Fence(storage, root, 1), retries=2, wait_timeout_s=60)
    assert not res.committed and "cannot be read" in res.error
    # Asked again as a failed write is retried (1 + retries), not polled until the 60 s bound.
    assert len(reads) == 3
    assert owes_retry(res.error)  # a storage failure: saved again later, not given up as "fenced:"
    assert step_dir(root, 10).rsplit("/", 1)[1] not in storage.list_dir(root)  # not one byte of it


def test_a_persist_asks_again_while_the_fence_cannot_be_read_and_commits_once_it_can(
        store, one_rank_group, monkeypatch):
    storage, root = store
    write_fence(storage, root, 1)
    reads = _unreadable_fence(storage, root, monkeypatch, "error", fails=2)
    res = _persist(storage, root, one_rank_group, 10, Fence(storage, root, 1), retries=2, wait_timeout_s=30)
    assert res.committed and len(reads) >= 3 and _steps(storage, root) == [10]


def test_a_commit_waits_for_a_readable_fence_within_its_retries(store, one_rank_group):
    """At the commit an unreadable fence is a storage failure: retried, and never committed on."""
    from elastic.checkpoint.retry import owes_retry
    storage, root = store
    cut = (None, "the fence cannot be read: read failed: ConnectionError")
    answers = [(True, ""), cut, cut, (True, "")]  # the save's, then the commit's
    res = _persist(storage, root, one_rank_group, 10, lambda: answers.pop(0) if len(answers) > 1 else answers[0],
                   retries=3)
    assert res.committed and _steps(storage, root) == [10]
    answers = [(True, ""), cut]
    res = _persist(storage, root, one_rank_group, 20, lambda: answers.pop(0) if len(answers) > 1 else answers[0],
                   retries=1)
    assert not res.committed and "cannot be read" in res.error and owes_retry(res.error)
    assert _steps(storage, root) == [10]


def test_retention_deletes_nothing_once_the_run_has_moved_on(store, one_rank_group):
    """A zombie's retention would delete checkpoints the run that moved on restores from."""
    storage, root = store
    for step in (10, 20):
        assert _persist(storage, root, one_rank_group, step, lambda: (True, "")).committed
    answers = [(True, ""), (True, ""), (False, "the run has moved on to generation 2 (this worker's: 1)")]
    res = _persist(storage, root, one_rank_group, 30, lambda: answers.pop(0) if len(answers) > 1 else answers[0],
                   num_to_keep=1)
    assert res.committed and answers == [answers[-1]]  # retention asked, and was told no
    assert _steps(storage, root) == [30, 20, 10]
    assert _persist(storage, root, one_rank_group, 40, lambda: (True, ""), num_to_keep=1).committed
    assert _steps(storage, root) == [40]  # a generation that may write applies it as before


def test_an_upload_stops_at_the_first_object_after_the_run_moved_on(store, one_rank_group, monkeypatch):
    """A worker frozen mid-upload that thaws after the run moved on used to upload the rest of its
    shards (the commit was refused, but the objects landed): now it stops before the next one."""
    from fsspec.implementations.memory import MemoryFileSystem

    from elastic.checkpoint.layout import step_dir
    storage, root = store
    write_fence(storage, root, 1)
    uploaded, real = [], MemoryFileSystem.put_file

    def put_file(self, lpath, rpath, *args, **kwargs):
        real(self, lpath, rpath, *args, **kwargs)
        uploaded.append(rpath)
        write_fence(storage, root, 2)  # the controller formed a new group during this upload
    monkeypatch.setattr(MemoryFileSystem, "put_file", put_file)
    res = _persist(storage, root, one_rank_group, 10, Fence(storage, root, 1), retries=2)
    assert not res.committed and res.error.startswith("fenced: rank 0: the run has moved on to generation 2")
    assert len(uploaded) == 1 and list(storage.sizes(step_dir(root, 10))) == [uploaded[0].rsplit("/", 1)[1]]
    assert res.attempts == 1  # not retried: a fence that moved on never moves back


# ---------------------------------------------------------------- the controller's own writes
def _commit(storage, root, step: int) -> None:
    from elastic.checkpoint.layout import Manifest, commit, step_dir
    commit(storage, step_dir(root, step), Manifest(step, step * 48, 3, "ddp", {}, 0.0))


def _drop_fence(c, generation: int) -> None:
    """The fence only rises: a test gives the run back to `c` by removing the newer file."""
    from elastic.checkpoint.fencing import generation_name
    c.storage.remove(join(c.root, FENCE, generation_name(generation)))


def test_a_rollback_un_commits_nothing_once_the_controller_no_longer_holds_the_run():
    """abandon_after removes commit markers: a controller whose generation is no longer the
    fence's (another one formed a newer group) would erase that one's checkpoints."""
    from elastic.controller import running
    from elastic.controller.states import Errored, Restoring
    from tests.test_controller import drive, make
    c, _, _ = make()
    drive(c, lambda c: c.step >= 5)
    for step in (4, 8, 12):
        _commit(c.storage, c.root, step)
    write_fence(c.storage, c.root, c.generation + 1)
    state = running.rollback(c, [9, 10, 11])
    assert isinstance(state, Errored) and "no longer holds the run" in state.error
    assert "shows generation" in state.error and _steps(c.storage, c.root) == [12, 8, 4]
    _drop_fence(c, c.generation + 1)  # its own again: the rollback goes ahead
    assert isinstance(running.rollback(c, [9, 10, 11]), Restoring) and _steps(c.storage, c.root) == [8, 4]


def test_metrics_and_ledger_are_written_only_while_the_controller_holds_the_run(monkeypatch):
    from tests.test_controller import drive, make
    c, _, _ = make(num_steps=12)
    drive(c, lambda c: c.step >= 5)
    write_fence(c.storage, c.root, c.generation + 1)
    out = c.run()  # to the end; the fence stays another's
    assert out["status"] == "finished" and c.events.of_kind("run_finished")  # the events log still records
    assert not c.storage.exists(join(c.run_dir, "metrics.json"))
    with pytest.raises(StorageError, match="ledger.json not written: this controller no longer holds the run"):
        c.run_log.write_ledger(c.storage, c.run_dir, c.fence.holds, 7, 48, c.step)
    assert not c.storage.exists(join(c.run_dir, "ledger.json"))
    _drop_fence(c, c.generation + 1)
    c.run_log.write_ledger(c.storage, c.run_dir, c.fence.holds, 7, 48, c.step)
    c.run_log.write_metrics(c.storage, c.run_dir, c.fence.holds)
    assert c.storage.exists(join(c.run_dir, "ledger.json")) and c.storage.exists(join(c.run_dir, "metrics.json"))
