"""A driver that lost its lease never writes again (issue 52 items 1-3, 11): the fence only rises
and is written only by a fresh lease holder; every controller state stops on a lost lease and
renews a stale one before it judges anyone; the lease is its holder's, not only a number's; and
nothing from a lapsed driver lands in the run folder after a takeover. Fake clock, `memory://`
storage, the fake worker group: no Ray."""
from __future__ import annotations

import hashlib
import uuid

import pytest

from elastic.checkpoint.fencing import FenceWriter, may_write, read_fence, write_fence
from elastic.checkpoint.lease import Lease, LeaseHeld
from elastic.controller.controller import Controller
from elastic.controller.states import Errored, Finished, Forming, Recovering, Running
from elastic.observability.events import EventLog, read_events
from elastic.storage import Storage, join
from tests.support.fake_group import FakeClock, FakeGroup
from tests.test_controller import drive, kinds, make


def listing(storage: Storage, run_dir: str) -> dict[str, str]:
    """Every file under the run folder with its contents' digest."""
    fs, root = storage.fs, storage.fs._strip_protocol(run_dir)
    return {p[len(root):]: hashlib.sha256(fs.cat_file(p)).hexdigest()[:16]
            for p in fs.find(root) if not fs.isdir(p)}


def take_over(c: Controller, clock: FakeClock) -> Controller:
    """`c`'s driver and controller freeze past the lease; a second driver takes the run and
    trains a step under its own generation."""
    clock.advance(c.job.run.lease_ttl_s + 1)
    newer = Controller(c.job.model_dump_json(), group=FakeGroup(clock), clock=clock, wall=clock)
    drive(newer, lambda n: n.step >= 1)
    newer.events.flush(timeout_s=5)
    return newer


# ---------------------------------------------------------------- the fence only rises
def test_a_lower_generation_written_late_never_lowers_the_fence():
    """The old `GENERATION` file was overwritten blindly: a lapsed driver's write of generation
    2 after the new holder's 1000001 let the lapsed one's workers commit and fenced the rightful
    ones out."""
    storage = Storage(f"memory://fence-{uuid.uuid4().hex}")
    root = join(storage.uri, "run", "checkpoints")
    write_fence(storage, root, 1_000_001)  # the driver that took over
    write_fence(storage, root, 2)  # the lapsed one, thawed in the middle of a recovery
    assert read_fence(storage, root) == 1_000_001
    assert may_write(storage, root, 1_000_001) == (True, "")
    ok, why = may_write(storage, root, 2)
    assert ok is False and "moved on to generation 1000001" in why


def test_a_fence_writer_whose_lease_is_stale_writes_nothing_until_a_renewal_lands():
    storage = Storage(f"memory://fence-{uuid.uuid4().hex}")
    root = join(storage.uri, "run", "checkpoints")
    allowed = {"ok": (False, "lease 1 is stale")}
    fence = FenceWriter(storage, root, backoff_s=0.01, allowed=lambda: allowed["ok"])
    assert not fence.announce(2, wait_s=0.2)
    assert read_fence(storage, root) is None and "stale" in str(fence.last_error)
    assert fence.holds() == (False, "lease 1 is stale")
    allowed["ok"] = (True, "")
    assert fence.announce(2, wait_s=5) and read_fence(storage, root) == 2 and fence.holds() == (True, "")


def test_a_holder_whose_fence_file_vanished_writes_it_again():
    storage = Storage(f"memory://fence-{uuid.uuid4().hex}")
    root = join(storage.uri, "run", "checkpoints")
    fence = FenceWriter(storage, root, backoff_s=0.01)
    assert fence.announce(3, wait_s=5)
    storage.remove_tree(join(root, "fence"))  # a lifecycle rule, a clean-up
    ok, why = fence.holds()
    assert not ok and "not there" in why
    for _ in range(500):
        if read_fence(storage, root) == 3:
            break
        import time
        time.sleep(0.01)
    assert read_fence(storage, root) == 3 and fence.holds() == (True, "")


# ---------------------------------------------------------------- the lapsed driver, end to end
def test_a_driver_thawed_after_a_takeover_stops_and_writes_nothing_and_the_holder_commits():
    """Item 1's sequence: A lapses, B takes the lease and writes its fence; A comes back before
    its renewal thread notices. Before, A's controller re-formed for a recovery (its own freeze
    counted as a hang) and wrote generation 2 over B's; A's persists committed and B's were
    fenced. Now A renews first, finds itself taken over and stops; the fence ends at B's
    generation; A's writes are refused, B's allowed; nothing of A lands after the takeover."""
    a, _, clock = make()
    drive(a, lambda c: c.step >= 5)
    a.events.flush(timeout_s=5)
    b = take_over(a, clock)
    assert b.generation > a.generation and read_fence(b.storage, b.root) == b.generation
    before = listing(a.storage, a.run_dir)
    # A thaws. It never called renew_once itself: its loop finds its own lease stale.
    a.step_once()
    assert isinstance(a.state, Errored) and "no longer owns the run" in a.state.error
    assert b.lease.holder in a.state.error
    out = a.run()  # A's end: events, metrics, the lease's release
    assert out["status"] == "error"
    a.fence.announce(a.generation + 1, wait_s=0.2)  # a late background fence write of A's
    a.events.flush(timeout_s=5)
    assert listing(a.storage, a.run_dir) == before  # not one file of A's since the takeover
    assert read_fence(b.storage, b.root) == b.generation
    assert may_write(a.storage, a.root, a.generation)[0] is False
    assert may_write(b.storage, b.root, b.generation) == (True, "")
    drive(b)
    assert isinstance(b.state, Finished)
    assert not [e for e in read_events(b.storage, b.run_dir) if e.get("kind") == "lease_lapsed"]


def test_a_stalled_controller_checks_its_lease_before_it_judges_anyone():
    """A controller frozen for 9 s counted its own freeze as the ranks' hang, replaced them all
    and formed a new generation before it looked at its lease. Now the iteration after a stall
    renews the lease at once and judges nobody; the next one, on polls taken after it, finds
    every rank training."""
    c, g, clock = make()
    drive(c, lambda c: c.step >= 5)
    clock.advance(9.0)  # the controller's own freeze: hang_floor_s is 5
    c.step_once()
    (stall,) = kinds(c, "controller_stalled")
    assert stall["stalled_s"] >= 9.0 and not stall["lease_lost"] and stall["reason"]
    assert c.lease.renewed_t == clock()  # renewed within the stalled iteration, before any verdict
    drive(c)
    assert isinstance(c.state, Finished)
    assert not kinds(c, "hang_detected") and not kinds(c, "silence_detected") and c.failures == 0


@pytest.mark.parametrize("state", [Forming(), Recovering((), 0.0)])
def test_every_state_stops_on_a_lost_lease_not_only_running(state):
    c, g, clock = make()
    drive(c, lambda c: c.step >= 3)
    take_over(c, clock)
    c.state = state
    num_forms = len(g.calls)
    c.step_once()
    assert isinstance(c.state, Errored) and "no longer owns the run" in c.state.error
    assert len(g.calls) == num_forms  # it formed, restored or replaced nothing


# ---------------------------------------------------------------- a lease held by a holder
@pytest.fixture
def run_dir():
    uri = f"memory://lease-{uuid.uuid4().hex}"
    return Storage(uri), join(uri, "run")


def test_a_lease_whose_record_vanished_is_still_held_and_never_taken_twice(run_dir):
    """newest() counted only `*.json`: with lease 1's record gone, a second driver took lease 1
    again, both numbered their groups from the same base, and neither saw itself lost."""
    storage, run = run_dir
    wall = FakeClock(1_000_000.0)
    first = Lease(storage, run, ttl_s=30, wall=wall)
    first.take()
    first.renew_once()
    storage.remove(join(run, "lease", "000000001.json"))
    wall.advance(5)
    with pytest.raises(LeaseHeld, match="lease 1 is held by unknown"):
        Lease(storage, run, ttl_s=30, wall=wall).take()
    first.renew_once()  # its holder writes its record again
    assert first.lost is None and first.newest().holder == first.holder


def test_two_holders_of_one_number_are_told_apart_by_identity(run_dir):
    storage, run = run_dir
    wall = FakeClock(1_000_000.0)
    first = Lease(storage, run, ttl_s=30, wall=wall)
    first.take()
    storage.remove_tree(join(run, "lease"))  # the whole folder lost
    wall.advance(31)
    second = Lease(storage, run, ttl_s=30, wall=wall)
    assert second.take().number == 1 == first.number
    first.renew_once()
    assert first.lost and second.holder in first.lost
    second.renew_once()
    assert second.lost is None


def _resubmit(age_s: float) -> Controller:
    """A first driver renewed `age_s` ago and stopped (its cluster lost); a resubmitted one starts."""
    c, _, clock = make()
    c.lease.take()
    c.lease.renew_once()
    clock.advance(age_s)
    second = Controller(c.job.model_dump_json(), group=FakeGroup(clock), clock=clock, wall=clock)
    second.step_once()
    return second


def test_a_resubmitted_driver_waits_out_a_lease_whose_holder_stopped_renewing():
    """A resubmit 26.6 s after the last renewal (ttl 30 s) was refused at once, using up
    KubeRay's retry; it now waits for the lease to expire and takes over."""
    second = _resubmit(26.6)
    (wait,) = kinds(second, "lease_wait")
    assert 3.0 <= wait["wait_s"] <= 3.5 and "held by" in wait["reason"]
    assert second.lease.number == 2 and not isinstance(second.state, Errored)


def test_a_resubmitted_driver_is_refused_at_once_while_the_holder_renews():
    second = _resubmit(5.0)
    assert isinstance(second.state, Errored) and "is in use" in second.state.error
    assert not kinds(second, "lease_wait") and second.lease.number is None


# ---------------------------------------------------------------- the event log
def test_a_stale_drivers_events_wait_in_memory_and_a_lost_ones_never_land():
    storage = Storage(f"memory://events-{uuid.uuid4().hex}")
    run = join(storage.uri, "run")
    fresh = {"v": (True, "")}
    log = EventLog(storage, run, may_write=lambda: fresh["v"], writer_id=lambda: 3)
    log.emit("one")
    log.flush(timeout_s=5)
    assert storage.list_dir(join(run, "events")) == ["000000003-000001.jsonl"]
    fresh["v"] = (False, "lease 3 is stale")
    log.emit("two")
    log.flush(timeout_s=5)
    assert [e["kind"] for e in read_events(storage, run)] == ["one"]
    fresh["v"] = (True, "")
    log.flush(timeout_s=5)
    assert [e["kind"] for e in read_events(storage, run)] == ["one", "two"]


def test_two_drivers_never_write_the_same_segment_and_the_log_reads_in_lease_order():
    """Each writer numbered its own segments from 1: a lapsed driver could overwrite the new
    holder's segment of the same number."""
    storage = Storage(f"memory://events-{uuid.uuid4().hex}")
    run = join(storage.uri, "run")
    old = EventLog(storage, run, writer_id=lambda: 1)
    new = EventLog(storage, run, writer_id=lambda: 2)
    new.emit("new_first")
    new.flush(timeout_s=5)
    old.emit("old_late")
    old.flush(timeout_s=5)
    assert sorted(storage.list_dir(join(run, "events"))) == ["000000001-000001.jsonl", "000000002-000001.jsonl"]
    assert [e["kind"] for e in read_events(storage, run)] == ["old_late", "new_first"]


def test_a_persist_refused_by_the_fence_is_named_as_fenced_not_as_storage():
    """The rightful run whose persists were fenced out ended with "resume from it once storage
    answers", blaming storage, which was fine."""
    c, g, clock = make(num_steps=12)
    g.final_commits = False
    g.commit_on_save_again = 0
    drive(c, lambda c: c.step >= 3)
    write_fence(c.storage, c.root, c.generation + 1_000_000)  # a newer driver's generation
    drive(c)
    assert isinstance(c.state, Errored)
    assert "fenced" in c.state.error and "storage answers" not in c.state.error
    assert str(c.generation + 1_000_000) in c.state.error
