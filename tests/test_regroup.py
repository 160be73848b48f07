"""Gathering a split tp group (elastic/controller/regroup.py), against a fake group: which warm
spare may take a rank of the group back beside the rest of it while stragglers are watched, and
when two ranks of one slot trade numbers instead."""
from __future__ import annotations

import math
import uuid

import pytest

from elastic.config import JobConfig
from elastic.controller import regroup
from elastic.controller.controller import Controller
from elastic.controller.states import Finished, Swapping, Trading
from tests.support.fake_group import FakeClock, FakeGroup, FakeRank
from tests.test_controller import _release_leases, calls, drive, kinds  # noqa: F401 (an autouse fixture: leases released)

pytestmark = pytest.mark.timeout(60)
A, B, C = ("node-a" + "0" * 50, "node-b" + "0" * 50, "node-c" + "0" * 50)


def controller(stragglers: bool) -> tuple[Controller, FakeGroup]:
    clock = FakeClock()
    job = JobConfig.model_validate({
        "run": {"name": "rg", "num_steps": 40},
        "scaling": {"num_workers": 4},
        "checkpoint": {"storage_uri": f"memory://rg-{uuid.uuid4().hex[:8]}"},
        "train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 48, "tp": {"size": 2}},
        "stragglers": {"enabled": stragglers},
    })
    group = FakeGroup(clock)
    # tp group 0 split over A and C (rank 1 was swapped onto C's spare); tp group 1 on B.
    group.members = {0: FakeRank(0, A, 1), 1: FakeRank(1, C, 2), 2: FakeRank(2, B, 3), 3: FakeRank(3, B, 4)}
    ctl = Controller(job.model_dump_json(), group=group, clock=clock, wall=clock)
    for r in range(4):  # the ranks' compute times: what a calibrated spare is weighed against
        ctl.stragglers.compute_s[r] = [0.01] * 4
    return ctl, group


@pytest.mark.parametrize("calib_s", [None, 0.011])
def test_a_spare_beside_the_group_gathers_it_timed_or_not(calib_s):
    """A spare on A (the node holding the rest of the group) takes rank 1 back there. One with
    no calibration (kept on the meta device, a pipeline's) is taken without a bound on its time."""
    ctl, group = controller(stragglers=True)
    group.ready_spares = [FakeRank(-1, A, 5, calib_s=calib_s)]
    planned = regroup.check(ctl)
    assert isinstance(planned, Swapping) and planned.rank == 1 and planned.to_node == A, planned
    assert ("Regroup", [1]) in [(e["decision"], e["ranks"]) for e in ctl.events.events if e["kind"] == "decision"]
    assert ctl.swap_healthy_s == (math.inf if calib_s is None else pytest.approx(0.01))


def test_no_uncalibrated_spare_regroups_onto_a_node_a_straggler_was_found_on():
    ctl, group = controller(stragglers=True)
    ctl.slow_nodes.add(A)
    group.ready_spares = [FakeRank(-1, A, 5, calib_s=None)]
    assert regroup.check(ctl) is None
    group.ready_spares = [FakeRank(-1, A, 5, calib_s=0.011)]  # timed, and fast: that node is fine now
    assert isinstance(regroup.check(ctl), Swapping)


def test_a_spare_too_slow_does_not_gather_it():
    ctl, group = controller(stragglers=True)
    group.ready_spares = [FakeRank(-1, A, 5, calib_s=0.05)]  # 5x the ranks' compute, over the 1.5x threshold
    assert regroup.check(ctl) is None
    ctl, group = controller(stragglers=False)  # nothing watched: any spare there
    group.ready_spares = [FakeRank(-1, A, 5, calib_s=0.05)]
    assert isinstance(regroup.check(ctl), Swapping) and ctl.swap_healthy_s == math.inf


def crosswise(strategy: str = "ddp", **failure) -> tuple[Controller, FakeGroup]:
    """dp 2 x tp 2 on two full nodes, each tp group split over both (replacements landed crosswise)."""
    clock = FakeClock()
    job = JobConfig.model_validate({
        "run": {"name": "tr", "num_steps": 40},
        "scaling": {"num_workers": 4},
        "failure": failure,
        "checkpoint": {"storage_uri": f"memory://tr-{uuid.uuid4().hex[:8]}"},
        "train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 48, "tp": {"size": 2},
                  "strategy": strategy},
    })
    group = FakeGroup(clock, ranks_per_node=2)
    group.members = {0: FakeRank(0, A, 1), 1: FakeRank(1, B, 2), 2: FakeRank(2, B, 3), 3: FakeRank(3, A, 4)}
    return Controller(job.model_dump_json(), group=group, clock=clock, wall=clock), group


def test_two_groups_split_over_full_nodes_trade_ranks_of_a_slot_instead_of_waiting_for_a_spare():
    ctl, group = crosswise()
    planned = regroup.check(ctl)  # no spare anywhere: only a trade can gather them
    assert isinstance(planned, Trading) and planned.ranks == (0, 2), planned
    assert ("Trade", [0, 2]) in [(e["decision"], e["ranks"]) for e in ctl.events.events if e["kind"] == "decision"]


@pytest.mark.parametrize("strategy, failure", [("fsdp", {}), ("ddp", {"peer_restore": False})])
def test_no_trade_where_the_replicas_state_differs_or_would_come_from_storage(strategy, failure):
    """fsdp's ranks of one slot hold different shards (a trade would move state), and with
    failure.peer_restore off the group would restore from storage: neither trades."""
    ctl, group = crosswise(strategy, **failure)
    assert regroup.check(ctl) is None


def test_a_trade_renumbers_the_two_and_the_run_goes_on_with_every_state_where_it_was():
    """Driven to the end against the fake group: the group starts whole (two ranks per node), is
    made crosswise mid-run, trades at a step boundary, forms again with the two renumbered and
    restores from its own replicas' memory (nothing from storage), gathered, to the last step."""
    ctl, group = crosswise()
    group.members = {}  # started by the controller: ranks 0-1 on one node, 2-3 on another
    drive(ctl, lambda c: c.step >= 5)
    x, y = group.members[0].node_id, group.members[2].node_id
    pids = {r: m.pid for r, m in group.members.items()}
    group.members[0].node_id, group.members[2].node_id = y, x  # as if replacements had landed crosswise
    drive(ctl)
    assert isinstance(ctl.state, Finished) and ctl.step == 40, ctl.state
    (traded,) = kinds(ctl, "traded")
    assert traded["ranks"] == [0, 2] and traded["tp_split_groups"] == [], traded
    # The processes kept, renumbered: the old rank 0 is rank 2 now, both tp groups on one node each.
    assert {r: m.pid for r, m in group.members.items()} == {0: pids[2], 1: pids[1], 2: pids[0], 3: pids[3]}
    assert group.members[0].node_id == group.members[1].node_id and group.members[2].node_id == group.members[3].node_id
    assert not calls(group, "kill") and not calls(group, "promote")
    assert calls(group, "restore_from_peer")[-1] == (0, (0, 1)), calls(group, "restore_from_peer")
    assert [c for c in calls(group, "restore") if c] == []  # nothing read from storage


def test_one_replica_of_a_tp_pipeline_is_not_regrouped_onto_a_spare():
    """pp 2 x tp 2 with one replica: each slot's state is in its one rank, and a planned swap
    offers nothing, so no spare can take rank 1 back beside rank 0 (the controller used to plan
    that move and fail on it: a warm spare per lost rank, each started on its own node, split the
    replaced tp group). The group stays split."""
    clock = FakeClock()
    job = JobConfig.model_validate({
        "run": {"name": "pp", "num_steps": 40},
        "scaling": {"num_workers": 4},
        "checkpoint": {"storage_uri": f"memory://pp-{uuid.uuid4().hex[:8]}"},
        "train": {"model": "m:f", "dataset": "m:f", "global_batch_size": 48, "tp": {"size": 2},
                  "strategy": "pipeline", "pipeline": {"stages": 2, "microbatches": 4, "loss": "m:f"}},
    })
    group = FakeGroup(clock)
    group.members = {0: FakeRank(0, A, 1), 1: FakeRank(1, C, 2), 2: FakeRank(2, B, 3), 3: FakeRank(3, B, 4)}
    group.ready_spares = [FakeRank(-1, A, 5, calib_s=None)]
    ctl = Controller(job.model_dump_json(), group=group, clock=clock, wall=clock)
    assert ctl.layout.dp == 1 and not ctl.shape.swappable(ctl.layout)
    assert regroup.check(ctl) is None


def test_a_group_split_over_full_nodes_moves_whole_to_a_node_with_a_spare_for_each_rank():
    """Group 0 spans A and C, and neither has a slot; D (a node that joined) holds a spare for each
    of its ranks: its highest rank moves there first, and the rest follow at the next check."""
    ctl, group = controller(stragglers=False)
    D = "node-d" + "0" * 50
    group.ready_spares = [FakeRank(-1, D, 5)]
    assert regroup.check(ctl) is None  # one spare there: moving one rank would not gather the group
    group.ready_spares.append(FakeRank(-1, D, 6))
    planned = regroup.check(ctl)
    assert isinstance(planned, Swapping) and planned.rank == 1 and planned.to_node == D, planned


def test_a_recovery_that_leaves_a_tp_group_split_names_it_with_why_and_how_it_mends():
    """A replacement that found no room beside its tp group: the recovery names the split group
    in a `tp_split` event, with the group's reason and how it will be gathered; the spares that
    gather it are asked for as the run goes on, though the pool keeps none."""
    ctl, group = crosswise()
    group.members = {}  # started by the controller: ranks 0-1 on one node, 2-3 on another
    drive(ctl, lambda c: c.step >= 5)
    group.split_reasons = {0: "no node has room for its 2 ranks together"}
    group.kill_process(1)
    drive(ctl, lambda c: kinds(c, "tp_split") and c.step >= 10)
    (split,) = kinds(ctl, "tp_split")
    (replaced,) = kinds(ctl, "workers_replaced")
    assert replaced["tp_split_groups"] == [0] and split["group"] == 0 and split["ranks"] == [0, 1], split
    assert split["nodes"]["0"] != split["nodes"]["1"], split
    assert split["reason"] == "no node has room for its 2 ranks together", split
    assert "step boundary" in split["mend"] and "train.tp.regroup" in split["mend"], split
    assert group.regroup_starts > 0  # num_spares is 0: asked all the same
