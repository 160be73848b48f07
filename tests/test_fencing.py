"""The fence (elastic/fencing.py): which generation may write, and a fence write that never
holds up a group formation while storage hangs, yet always lands, in order."""
import threading
import time
import uuid

import pytest

from elastic.checkpoint.fencing import FenceWriter, current_generation, may_write, write_fence
from elastic.storage import Storage, StorageError, call_within


@pytest.fixture
def store():
    root = f"memory://fence-{uuid.uuid4().hex}/run/checkpoints"
    return Storage(root), root


def test_only_the_generation_the_fence_shows_may_write(store):
    storage, root = store
    assert may_write(storage, root, 1) == (True, "")  # no fence yet (or unreadable): storage decides
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
