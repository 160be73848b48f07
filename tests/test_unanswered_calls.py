"""A Ray call that is never answered (its actor's node frozen: Ray still lists it alive) holds
nothing for good: a copy sent to a frozen buddy, a chaos fault's report to a controller that
does not answer. On a one-node Ray of the module's own, with stand-in actors."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import ray
import torch

from elastic.runtime.faults import fire_fault
from elastic.runtime.memory_copies import MemoryCopies
from tests.ray_fixtures import one_node_ray

pytestmark = pytest.mark.timeout(180)

BOUND_S = 2.0  # failure.collective_timeout_s of these stand-in workers


@pytest.fixture(scope="module")
def local_ray():
    with one_node_ray(__name__):
        yield


class NeverAnswers:
    """A buddy or a controller on a frozen node: every call is taken and never answered."""

    def where(self) -> bool:
        return True

    def hold_copy(self, rank: int, generation: int, part: dict) -> bool:
        threading.Event().wait()
        return True

    def report_fault(self, *args) -> None:
        threading.Event().wait()


class Buddy:
    def __init__(self):
        self.held: list[tuple[int, int, int]] = []

    def hold_copy(self, rank: int, generation: int, part: dict) -> bool:
        self.held.append((rank, generation, part["step"]))
        return True

    def copies(self) -> list[tuple[int, int, int]]:
        return self.held


def _worker(**kw) -> SimpleNamespace:
    def offer(st, rank, world, step, into=None) -> dict:
        return {"step": step, "part": rank, "t": torch.ones(4)}

    strategy = SimpleNamespace(state_dict=lambda model, opt: {}, offer=offer)
    job = SimpleNamespace(failure=SimpleNamespace(collective_timeout_s=BOUND_S))
    return SimpleNamespace(rank=0, world_size=2, step=1, model=None, optimizer=None, amp=None,
                           strategy=strategy, job=job, **kw)


def _senders() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "memory-copy" and t.is_alive()}


def test_a_copy_sent_to_a_frozen_buddy_ends_at_its_bound_and_holds_back_no_later_group(local_ray):
    """Rank 0's copy goes to a buddy whose node froze. The group re-forms without it: the send
    still on its way is the old group's and holds the new group's copies back no more (it made
    this rank vote against every copy, for the rest of the run); it ends at
    failure.collective_timeout_s."""
    frozen = ray.remote(max_concurrency=4, num_cpus=0)(NeverAnswers).remote()
    buddy = ray.remote(num_cpus=0)(Buddy).remote()
    assert ray.get(frozen.where.remote(), timeout=60)
    copies, w = MemoryCopies(every_steps=1), _worker()
    copies.start(1, (1, frozen))
    copies.take(w)
    stuck = _senders()
    assert stuck and copies.sending()  # on its way to the frozen buddy
    copies.start(2, (2, buddy))  # the group re-formed without the frozen rank
    assert not copies.sending(), "a send of the old group holds back the new group's copies"
    w.step = 2
    copies.take(w)
    for t in _senders() - stuck:
        t.join(60)
    # The new group's copy reached its buddy.
    assert ray.get(buddy.copies.remote(), timeout=60) == [(0, 2, 2)]
    for t in stuck:
        t.join(60)  # a backstop far past the bound: it ends at BOUND_S
    assert not any(t.is_alive() for t in stuck), "the send to the frozen buddy never ends"
    ray.kill(frozen)


def test_a_chaos_fault_whose_report_is_never_answered_fires_at_the_bound(local_ray):
    """The worker tells the controller before it faults; a controller that never answers used to
    hold the rank there for good. Now the fault fires once failure.collective_timeout_s passed."""
    controller = ray.remote(max_concurrency=4, num_cpus=0)(NeverAnswers).remote()
    assert ray.get(controller.where.remote(), timeout=60)
    w = _worker(controller=controller, ckpt=None, generation=1, slow_factor=1.0)
    fault = {"action": "slow", "factor": 3.0, "rank": 0, "at_step": 1}
    t = threading.Thread(target=fire_fault, args=(w, fault), daemon=True)
    t.start()
    t.join(60)  # a backstop far past the bound
    assert not t.is_alive(), "the fault waits for a report nobody answers"
    assert w.slow_factor == 3.0  # and it fired
    ray.kill(controller)
