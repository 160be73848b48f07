"""Where the spare pool starts and keeps workers with tensor parallelism (elastic/group/spares.py,
elastic/group/replacing.py), without Ray: the actor starts and kills are stubbed, and each test
reads where they went. The placement decisions themselves are tests/test_placement.py's; the
drills on a real cluster, tests/test_tp_chaos.py's."""
from __future__ import annotations

import itertools

import pytest

from elastic.config import JobConfig
from elastic.group import replacing, spares
from elastic.group.member import Member
from elastic.group.spares import SparePool

pytestmark = pytest.mark.timeout(60)


class _Call:
    _ids = itertools.count()

    def remote(self, *args, **kwargs) -> str:
        return f"ref-{next(self._ids)}"


class _Handle:
    """A worker actor that is never started: `warm.remote()` gives a fresh stand-in ref."""

    warm = _Call()


def pool(tp: int = 2, monkeypatch=None) -> tuple[SparePool, list]:
    """A pool of a dp 2 x tp job whose actor starts are recorded (the node each was asked for)."""
    job = JobConfig.model_validate({
        "run": {"name": "pool", "num_steps": 1}, "scaling": {"num_workers": 2 * tp, "cpus_per_worker": 0.5},
        "checkpoint": {"storage_uri": "memory://pool"},
        "train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 48, "tp": {"size": tp}}})
    p = SparePool(job, job.model_dump_json(), "memory://pool", None, None)
    p.members = {}  # the group's (WorkerGroup sets it)
    started: list = []
    p._new_actor = lambda background=False, node=None, prestarted=False: started.append(node) or _Handle()
    if monkeypatch is not None:
        monkeypatch.setattr(replacing, "placing_node", lambda handle: None)
    return p, started


def member(rank: int, node: str) -> Member:
    return Member(rank, _Handle(), node, "10.0.0.1", 1000 + rank)


def test_the_first_replacement_of_a_process_kill_starts_in_the_slot_it_left():
    """Cause 2 of the split in issue 55: at a fault's first signal the controller starts a worker
    on demand, naming the nodes of the ranks whose process died (`near`: their slots are being
    freed). With tensor parallelism it went where Ray's SPREAD put it, another node as a rule,
    and, ready before the one started beside the group, took the rank (1 of 2 runs)."""
    p, started = pool()
    p.add_spares(1, on_demand=True, near=("A",))
    assert started == ["A"] and list(p.meant.values()) == ["A"]
    p, started = pool(tp=1)  # no tp group to stay beside: Ray's SPREAD places it, as before
    p.add_spares(1, on_demand=True, near=("A",))
    assert started == [None] and p.meant == {}


def test_workers_started_at_a_node_loss_start_together(monkeypatch):
    """A node lost (no dead process's slot to name): the workers started at the first signal go
    a tp group's worth to a node, so the group lost whole finds them together, not one per node
    by Ray's SPREAD, each a third worker beside the two its group's home then starts."""
    p, started = pool(monkeypatch=monkeypatch)
    monkeypatch.setattr(p, "_free_cpus", lambda: {"A": 0.0, "C": 1.0, "D": 1.0})
    p.add_spares(2, on_demand=True)
    assert started == ["C", "C"], started


def test_workers_start_on_their_home_once_per_rank_no_worker_there_covers(monkeypatch):
    p, started = pool(monkeypatch=monkeypatch)
    p.add_spares(1, on_demand=True, at=("C",))  # one already starting on C
    started.clear()
    p._start_for([2, 3, 5], {2: "C", 3: "C"})
    # One more on C (two ranks there, one worker on its way); rank 5 has no home: anywhere.
    assert sorted(started, key=str) == ["C", None], started


def test_a_trim_keeps_the_spares_that_can_gather_a_split_tp_group(monkeypatch):
    p, _ = pool(monkeypatch=monkeypatch)
    killed: list[str] = []
    monkeypatch.setattr(spares, "kill_member", lambda m: killed.append(m.node_id))
    p.members.update({0: member(0, "A"), 1: member(1, "C"), 2: member(2, "B"), 3: member(3, "B")})
    p.ready_spares = [member(-1, "A"), member(-1, "D")]  # the one on A gathers group 0 (ranks 0, 1)
    p.trim_spares(0)
    assert killed == ["D"] and [m.node_id for m in p.ready_spares] == ["A"]
    p.trim_spares(0, regroup=False)  # shutting down: every spare goes
    assert killed == ["D", "A"] and p.ready_spares == []


def test_a_split_group_gets_spares_where_the_whole_of_it_fits_without_a_pool(monkeypatch):
    """`scaling.num_spares: 0`: a group split over full nodes A and C is still mended once a node
    with room for all of it (D) is there: a spare per rank starts on D."""
    p, started = pool(monkeypatch=monkeypatch)
    p.members.update({0: member(0, "A"), 1: member(1, "C"), 2: member(2, "B"), 3: member(3, "B")})
    monkeypatch.setattr(p, "_free_cpus", lambda: {"A": 0.0, "B": 0.0, "C": 0.0, "D": 1.0})
    assert p.start_regroup_spares() == 2 and started == ["D", "D"]
    assert p.start_regroup_spares() == 0 and started == ["D", "D"]  # already starting there: no more
    p.members[1] = member(1, "A")  # gathered: nothing to start
    started.clear()
    assert p.start_regroup_spares() == 0 and started == []


def test_a_split_group_with_a_spare_on_one_of_its_nodes_gets_no_second_one(monkeypatch):
    """A straggler's rank 1 was swapped from C onto A; the refill starts on C, in the slot it
    left (name order would say A). Once that spare holds C's slot, no second one starts on A
    (room there too): two would race, and rank 0 could be moved to A instead of rank 1 back
    beside it (the tp straggler drill, after c7dc096)."""
    p, started = pool(monkeypatch=monkeypatch)
    p.members.update({0: member(0, "C"), 1: member(1, "A"), 2: member(2, "B"), 3: member(3, "B")})
    p.vacated[1] = "C"
    free = {"A": 0.5, "B": 0.0, "C": 0.5}
    monkeypatch.setattr(p, "_free_cpus", lambda: dict(free))
    assert p.start_regroup_spares() == 1 and started == ["C"]  # the slot rank 1 was taken from
    free["C"] = 0.0  # the spare holds it now
    assert p.start_regroup_spares() == 0 and started == ["C"]  # none on A
