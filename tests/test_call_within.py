"""`call_within` (elastic/storage.py): a storage call that must not hold up a decision. A call
into a mount that hangs leaves its thread behind; those threads are bounded per purpose."""
from __future__ import annotations

import threading

import pytest

from elastic.storage import HUNG_PER_PURPOSE, call_within, hung_calls

pytestmark = pytest.mark.timeout(60)


def _storage_call_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "storage-call"]


def test_calls_into_a_hung_mount_leave_at_most_the_cap_of_threads_and_ask_again_once_one_returns():
    """A lease renewal asks every ttl_s / 4: on a mount that hangs, each call used to leave one
    more thread behind, for good. Past the cap the call is not answered at once, and nothing
    starts; calls of another purpose are not held back; once the hung calls return, the next
    one is made again."""
    release = threading.Event()
    made = []

    def renew() -> str:
        made.append(1)
        release.wait()
        return "renewed"

    before = set(_storage_call_threads())
    try:
        answers = [call_within(renew, 0.05, purpose="renewal") for _ in range(10)]
        assert all(a == (False, None, None) for a in answers), answers
        assert len(made) == HUNG_PER_PURPOSE, f"{len(made)} calls made into the hung mount"
        assert hung_calls("renewal") == HUNG_PER_PURPOSE
        assert len(set(_storage_call_threads()) - before) == HUNG_PER_PURPOSE
        assert call_within(lambda: 7, 5, purpose="another") == (True, 7, None)
    finally:
        release.set()
    for t in set(_storage_call_threads()) - before:
        t.join(10)
    assert hung_calls("renewal") == 0
    assert call_within(renew, 5, purpose="renewal") == (True, "renewed", None)
    assert len(made) == HUNG_PER_PURPOSE + 1


class _Mount:
    """A store whose reads hang until released, counting the reads made."""

    def __init__(self):
        self.reads, self.release = 0, threading.Event()

    def read(self) -> str:
        self.reads += 1
        self.release.wait()
        return "read"


def test_the_purpose_is_the_call_site_and_a_bound_method_s_instance_by_default():
    """Without a purpose, one call site's hung calls hold back that site alone: two mounts'
    `read` are two purposes, one mount's calls one."""
    a, b = _Mount(), _Mount()
    try:
        answers = [call_within(a.read, 0.05) for _ in range(4)] + [call_within(b.read, 0.05)]
        assert all(x == (False, None, None) for x in answers), answers
        assert (a.reads, b.reads) == (HUNG_PER_PURPOSE, 1)
        b.release.set()
        assert call_within(b.read, 5) == (True, "read", None)
    finally:
        a.release.set()
        b.release.set()


def test_a_closure_is_one_purpose_per_object_it_closes_over():
    """The controller's storage calls are lambdas over `ctl`: one run's hung calls (an outage
    that never answered) refused the next run in the same process its own store, so its lease
    was never released and the resubmission behind it failed. The same code over another object
    is another purpose."""
    def reader(mount: _Mount):
        return lambda: mount.read()

    a, b = _Mount(), _Mount()
    try:
        answers = [call_within(reader(a), 0.05) for _ in range(4)] + [call_within(reader(b), 0.05)]
        assert all(x == (False, None, None) for x in answers), answers
        assert (a.reads, b.reads) == (HUNG_PER_PURPOSE, 1)
        b.release.set()
        assert call_within(reader(b), 5) == (True, "read", None)
    finally:
        a.release.set()
        b.release.set()
