"""One live run per run folder (elastic/checkpoint/lease.py): a second driver is refused while the
lease is fresh, an expired or released lease is taken over, a holder whose lease was taken over
knows it, and a store that ignores exclusive creates cannot give the lease to two drivers."""
from __future__ import annotations

import uuid

import pytest

from elastic.checkpoint.lease import GENERATION_STRIDE, Lease, LeaseHeld
from elastic.storage import Storage, join


class Wall:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["memory", "file"])
def run_dir(request, tmp_path):
    uri = f"memory://lease-{uuid.uuid4().hex}" if request.param == "memory" else f"file://{tmp_path}"
    return Storage(uri), join(uri, "run")


def test_a_second_driver_is_refused_naming_the_holder_and_the_lease_age(run_dir):
    storage, run = run_dir
    wall = Wall()
    first = Lease(storage, run, ttl_s=30, wall=wall)
    assert first.take().number == 1 and first.generation_base() == 0  # a run's first driver: 1, 2, ...
    wall.t += 12.5
    with pytest.raises(LeaseHeld, match=rf"held by {first.holder} .*renewed 12.5 s ago .*lease_ttl_s=30"):
        Lease(storage, run, ttl_s=30, wall=wall).take()
    first.renew_once()  # a renewal makes it fresh again
    wall.t += 29
    with pytest.raises(LeaseHeld, match="renewed 29.0 s ago"):
        Lease(storage, run, ttl_s=30, wall=wall).take()


def test_an_expired_lease_is_taken_over_and_its_old_holder_learns_it_lost_the_run(run_dir):
    storage, run = run_dir
    wall = Wall()
    first = Lease(storage, run, ttl_s=30, wall=wall)
    first.take()
    wall.t += 31  # its driver is gone: no renewal for ttl_s (a KubeRay retry after the head was lost)
    second = Lease(storage, run, ttl_s=30, wall=wall)
    assert second.take().number == 2
    assert second.generation_base() == GENERATION_STRIDE  # its groups fence the old driver's out
    first.renew_once()  # the old holder comes back (a healed partition)
    assert first.lost and second.holder in first.lost
    second.renew_once()
    assert second.lost is None


def test_a_take_that_timed_out_but_landed_is_this_drivers_own(run_dir):
    """The controller gives up on a take that storage answers late and asks again: the lease its
    first call took meanwhile is its own, not another driver's."""
    storage, run = run_dir
    lease = Lease(storage, run, ttl_s=30, wall=Wall())
    first = lease.take()
    again = lease.take()
    assert again.number == first.number == lease.number == 1


def test_a_released_lease_is_free_at_once(run_dir):
    storage, run = run_dir
    wall = Wall()
    first = Lease(storage, run, ttl_s=30, wall=wall)
    first.take()
    first.release()
    assert Lease(storage, run, ttl_s=30, wall=wall).take().number == 2


def test_a_store_that_ignores_exclusive_creates_still_gives_the_lease_to_one_driver(run_dir, monkeypatch):
    """Two drivers find the lease expired at the same moment and both write lease 2; on a store
    without conditional writes the later write wins, and the driver whose write did not survive
    reads that back and steps aside."""
    storage, run = run_dir
    wall = Wall()
    Lease(storage, run, ttl_s=30, wall=wall).take()
    wall.t += 31
    a, b = Lease(storage, run, ttl_s=30, wall=wall), Lease(storage, run, ttl_s=30, wall=wall)
    real_create = storage.create

    def racy_create(uri: str, data: bytes) -> bool:
        storage.write_bytes(uri, data)  # what a store that ignores If-None-Match does: it overwrites
        if uri.endswith("000000002.json") and b"%s" % a.holder.encode() in data:
            body = data.replace(a.holder.encode(), b.holder.encode())
            storage.write_bytes(uri, body)  # b's write of the same name lands just after a's
        return True

    monkeypatch.setattr(storage, "create", racy_create)
    with pytest.raises(LeaseHeld, match=f"another driver \\({b.holder}\\) took lease 2"):
        a.take()
    monkeypatch.setattr(storage, "create", real_create)


def test_exclusive_create_refuses_an_existing_name(run_dir):
    storage, run = run_dir
    uri = join(run, "lease", "x.json")
    assert storage.create(uri, b"1") is True
    assert storage.create(uri, b"2") is False
    assert storage.read_bytes(uri) == b"1"


@pytest.mark.s3
def test_on_s3_the_lease_is_created_exclusively_and_a_second_driver_is_refused(s3_server):
    """SeaweedFS honours If-None-Match: a second exclusive create of a key is refused by the
    store itself (412), not only by the read-back."""
    uri = f"{s3_server.uri}/lease-{uuid.uuid4().hex[:8]}"
    storage = Storage(uri, s3_server.storage_options)
    key = join(uri, "x.json")
    assert storage.create(key, b"1") is True and storage.create(key, b"2") is False
    assert storage.read_bytes(key) == b"1"
    first = Lease(storage, join(uri, "run"), ttl_s=30)
    first.take()
    with pytest.raises(LeaseHeld, match=first.holder):
        Lease(storage, join(uri, "run"), ttl_s=30).take()


@pytest.mark.timeout(30)
def test_a_renewal_that_hangs_lapses_the_lease_without_losing_the_run_and_release_does_not_wait(run_dir):
    """A renewal call that storage never answered stopped the renewal thread for good. Now each
    renewal has ttl_s / 4: past ttl_s without one the lease has lapsed (said, with why), but a
    storage outage alone does not take the run from its driver (a 40 s outage ended a run that
    needed no storage to train); once storage answers, the next renewal lands and it holds again."""
    import threading
    import time

    storage, run = run_dir
    lease = Lease(storage, run, ttl_s=0.4)
    lease.take()
    hung = threading.Event()
    real_write = storage.write_bytes

    def write(uri, data):
        if not hung.is_set():
            hung.wait()  # storage takes the request and answers only once it is back
        return real_write(uri, data)
    storage.write_bytes = write
    lease.start_renewing()
    deadline = time.monotonic() + 20
    while lease.lapsed_s() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lease.lapsed_s() is not None and "not answered within 0.1 s" in lease.last_error
    assert lease.lost is None
    hung.set()  # storage is back
    while lease.lapsed_s() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lease.lapsed_s() is None and lease.lost is None
    storage.write_bytes = lambda uri, data: threading.Event().wait()  # and hangs again, for good
    lease.release()  # returns, though its write would hang
