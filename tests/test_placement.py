"""Where replacements go with tensor parallelism (elastic/policies/placement.py): pure decisions.
The drills on a real cluster are in tests/test_tp_chaos.py."""
from __future__ import annotations

import math

from elastic.policies.placement import (group_node, homes_kept, pick_spare, regroup_move, regroup_nodes,
                                        replacement_homes, spare_homes, split_groups, take_rank, trade_move)


# ---------------------------------------------------------------- replacements beside their tp group
def homes(*args, **kwargs) -> dict[int, str]:
    return replacement_homes(*args, **kwargs).homes


def test_a_replacement_goes_to_its_tp_groups_node_when_it_has_room():
    members = {0: "A", 2: "B", 3: "B"}  # rank 1 (tp group 0, on A) was lost; its slot on A is free
    # A warm spare on C does not pull rank 1 off its group's node: A has the room.
    assert homes([1], 2, members, ["C"], {"A": 1.0, "B": 0.0, "C": 0.0}, 1.0) == {1: "A"}
    # A spare on A is the best of both.
    assert homes([1], 2, members, ["A", "C"], {"A": 0.0, "B": 0.0, "C": 0.0}, 1.0) == {1: "A"}
    # No room on A, nor for the whole group anywhere: no home; the rank goes wherever a worker
    # is (its group then spans nodes), and the plan says why.
    got = replacement_homes([1], 2, members, ["C"], {"A": 0.0, "B": 0.0, "C": 0.0}, 1.0)
    assert got.homes == {} and "no node has room for its 2 ranks together" in got.split[0], got
    # Slots count in workers' CPUs.
    assert homes([1], 2, members, [], {"A": 1.0}, 2.0) == {}


def test_the_slot_of_a_dead_process_is_room_for_its_replacement():
    # Ray does not show rank 1's slot on A free yet: its own dead process's slot counts.
    members = {0: "A", 2: "B", 3: "B"}
    assert homes([1], 2, members, [], {"A": 0.0, "B": 0.0, "C": 1.0}, 0.5, freed={1: "A"}) == {1: "A"}
    assert homes([1], 2, members, [], {"A": 0.0, "B": 0.0}, 0.5, freed={1: "X"}) == {}  # a node gone: none


def test_a_tp_group_lost_whole_goes_where_most_of_it_fits():
    members = {2: "B", 3: "B"}  # tp group 0 (ranks 0, 1) lost with node A
    assert homes([0, 1], 2, members, ["C"], {"B": 0.0, "C": 1.0, "D": 1.0}, 1.0) == {0: "C", 1: "C"}
    # Room for one rank only, on each of two nodes: one rank there, the other placed as before.
    got = replacement_homes([0, 1], 2, members, [], {"C": 1.0, "D": 1.0}, 1.0)
    assert got.homes == {0: "C"} and "node C took 1" in got.split[0], got
    # Two groups lost: each takes room once, in rank order.
    got = homes([0, 1, 2, 3], 2, {}, [], {"C": 2.0, "D": 2.0}, 1.0)
    assert got == {0: "C", 1: "C", 2: "D", 3: "D"}


def test_a_group_lost_whole_goes_where_a_worker_for_it_is_already_starting():
    """Cause 3 of the split in issue 55: the home ignored the worker started at the fault's first
    signal. Tp group 1 (ranks 2, 3) was lost with its node; C and D each have room for both, and
    that worker is on D: the group goes to D (name order would say C, and then three workers
    start for two ranks, one of them on D)."""
    got = replacement_homes([2, 3], 2, {0: "A", 1: "A"}, ["D"], {"A": 0.0, "C": 1.0, "D": 0.5}, 0.5)
    assert got.homes == {2: "D", 3: "D"} and got.split == {}, got


def test_a_rank_whose_groups_node_is_full_goes_where_the_whole_group_fits_and_its_survivors_follow():
    members = {0: "A", 2: "B", 3: "B"}  # rank 1 lost; the slot it left on A was taken meanwhile
    got = replacement_homes([1], 2, members, [], {"A": 0.0, "B": 0.0, "C": 0.5, "D": 1.0}, 0.5)
    assert got.homes == {1: "D"} and got.follow == {0: "D"}, got
    assert "rank(s) [0] follow at a step boundary" in got.split[0], got
    # A spare on C and a free slot beside it: room for all of the group there too, the spare wins.
    got = replacement_homes([1], 2, members, ["C"], {"A": 0.0, "B": 0.0, "C": 0.5, "D": 1.0}, 0.5)
    assert got.homes == {1: "C"} and got.follow == {0: "C"}, got


def test_a_worker_takes_a_rank_only_on_its_home():
    """Cause 1 of the split in issue 55: a worker started on demand took any missing rank. Tp
    group 1's node was killed; its ranks' home is C, and the worker started at the fault's first
    signal came up on D first: it takes neither (it took rank 2, and the group spanned C and D)."""
    at_c = {2: "C", 3: "C"}
    assert take_rank([2, 3], at_c, "D") is None
    assert take_rank([2, 3], at_c, "C") == 2
    assert take_rank([1, 2, 3], at_c, "D") == 1  # a rank without a home goes to any worker
    assert take_rank([], at_c, "C") is None


def test_a_home_is_given_up_only_when_it_cannot_be_reached():
    at_c = {2: "C", 3: "C", 5: "E"}
    kept, dropped = homes_kept(at_c, [2, 3, 5], set(), set(), 1.0, 5.0)
    assert kept == at_c and dropped == {}
    kept, dropped = homes_kept(at_c, [2, 3, 5], {"C"}, set(), 1.0, 5.0)  # C lost while its workers started
    assert kept == {5: "E"} and sorted(dropped) == [2, 3] and "was lost" in dropped[2]
    kept, dropped = homes_kept(at_c, [3, 5], set(), {"E"}, 1.0, 5.0)  # Ray put E's worker elsewhere
    assert kept == {3: "C"} and "placed elsewhere" in dropped[5]
    kept, dropped = homes_kept(at_c, [3], set(), set(), 5.0, 5.0)  # none came up there in time
    assert kept == {} and "within 5 s" in dropped[3]


def test_split_groups_names_the_tp_groups_that_span_nodes():
    assert split_groups({0: "A", 1: "A", 2: "B", 3: "C"}, 2) == [2]
    assert split_groups({0: "A", 1: "A"}, 2) == []


# ---------------------------------------------------------------- a straggler's spare beside its tp group
def test_a_stragglers_spare_is_taken_on_its_tp_groups_node_first():
    members = {0: "A", 1: "A", 2: "B", 3: "B"}
    assert group_node(1, 2, members) == "A"  # its peer's node, not its own entry
    assert group_node(1, 2, {0: "C", 1: "A"}) == "C"
    assert group_node(1, 1, members) is None  # no tp: no group to keep together
    spares = [("C", 0.10), ("A", 0.12), ("A", 0.30)]
    # The fastest fast-enough spare on A, though one elsewhere is faster.
    assert pick_spare(spares, 0.2, "A") == 1
    # None on A fast enough: the fastest anywhere (the group then spans nodes).
    assert pick_spare(spares, 0.11, "A") == 0
    assert pick_spare(spares, 0.2, None) == 0
    # Too slow, or never calibrated: none.
    assert pick_spare([("A", None), ("C", 0.5)], 0.2, "A") is None
    # No bound (a regroup with stragglers off): any spare, the home node's first.
    assert pick_spare([("C", 0.1), ("A", None)], math.inf, "A") == 1
    assert pick_spare([("C", None), ("D", 0.3)], math.inf, "A") == 1  # calibrated first elsewhere


# ---------------------------------------------------------------- gathering a split tp group
def test_a_refill_goes_where_it_can_gather_a_split_tp_group():
    # Group 0 spans A and C (a straggler's spare took rank 1 to C); group 1 is whole on B.
    members = {0: "A", 1: "C", 2: "B", 3: "B"}
    assert regroup_nodes(members, 2, {"A": 0.5, "B": 0.0, "C": 0.5, "D": 1.0}, 0.5) == ["A"]  # name order on a tie
    assert regroup_nodes(members, 2, {"A": 0.0, "C": 0.5, "D": 1.0}, 0.5) == ["C"]  # A is full
    # A tie between the group's nodes goes to the one its rank was taken from (a straggler's slot).
    assert regroup_nodes(members, 2, {"A": 0.5, "C": 0.5}, 0.5, prefer={"C"}) == ["C"]
    # Neither node of its own has room, nor another for all of it.
    assert regroup_nodes(members, 2, {"A": 0.0, "C": 0.0, "D": 0.5}, 0.5) == []
    assert regroup_nodes({0: "A", 1: "A", 2: "B", 3: "B"}, 2, {"A": 1.0}, 0.5) == []  # nothing split
    # tp 4: three on A, one on B: one spare on A (the node holding most of it), not three on B.
    assert regroup_nodes({0: "A", 1: "A", 2: "B", 3: "A"}, 4, {"A": 1.0, "B": 2.0}, 0.5) == ["A"]
    # Two off A: as many spares there as it has room for.
    assert regroup_nodes({0: "A", 1: "A", 2: "B", 3: "C"}, 4, {"A": 2.0}, 0.5) == ["A", "A"]
    assert regroup_nodes({0: "A", 1: "A", 2: "B", 3: "C"}, 4, {"A": 0.5}, 0.5) == ["A"]


def test_a_node_with_room_for_a_whole_split_group_gets_a_spare_per_rank():
    # Group 0 spans A and C, both full; D (a node that joined) has room for all of it.
    members = {0: "A", 1: "C", 2: "B", 3: "B"}
    assert regroup_nodes(members, 2, {"A": 0.0, "C": 0.0, "D": 1.0}, 0.5) == ["D", "D"]
    # The first move goes to D; then D holds part of the group and the rest follows.
    assert regroup_move(members, 2, [("D", 0.1), ("D", 0.1)], 0.2) == (1, "D")
    assert regroup_move({**members, 1: "D"}, 2, [("D", 0.1)], 0.2) == (0, "D")
    assert regroup_move(members, 2, [("D", 0.1), ("D", 0.3)], 0.2) is None  # one of the two too slow


def test_a_warm_spare_on_part_of_a_split_group_gathers_it():
    members = {0: "A", 1: "C", 2: "B", 3: "B"}
    # A spare on A: the rank off A (rank 1) moves there.
    assert regroup_move(members, 2, [("A", 0.1)], 0.2) == (1, "A")
    # A spare on C: rank 0 moves to C instead.
    assert regroup_move(members, 2, [("C", 0.1)], 0.2) == (0, "C")
    # A spare on a node the group is not on does not gather it; nor does one too slow; without a
    # bound (stragglers off) any spare does.
    assert regroup_move(members, 2, [("D", 0.1)], 0.2) is None
    assert regroup_move(members, 2, [("A", 0.3)], 0.2) is None
    assert regroup_move(members, 2, [("A", None)], None) == (1, "A")
    # One with nothing to time it (kept on meta, a pipeline's) gathers it with a bound known,
    # unless a straggler was found on its node; a calibrated one is judged by its calibration.
    assert regroup_move(members, 2, [("A", None)], 0.2) == (1, "A")
    assert regroup_move(members, 2, [("A", None)], 0.2, {"A"}) is None
    assert regroup_move(members, 2, [("A", None), ("C", 0.1)], 0.2, {"A"}) == (0, "C")
    assert regroup_move(members, 2, [("A", 0.1)], 0.2, {"A"}) == (1, "A")
    assert regroup_move(members, 2, [("A", None)], None, {"A"}) == (1, "A")  # stragglers off: no node kept out
    # tp 4, three on A: the one on B moves to A, even with a spare on B too.
    assert regroup_move({0: "A", 1: "A", 2: "B", 3: "A"}, 4, [("B", 0.1), ("A", 0.1)], 0.2) == (2, "A")
    assert regroup_move({0: "A", 1: "A", 2: "B", 3: "B"}, 2, [("A", 0.1)], 0.2) is None  # nothing split


def test_two_split_groups_over_the_same_nodes_trade_ranks_of_one_slot():
    # dp 2 x tp 2 on two full nodes, each tp group split over both: ranks 0 and 2 (slot 0) trade.
    assert trade_move({0: "A", 1: "B", 2: "B", 3: "A"}, 2, 2) == (0, 2)
    # Only ranks of the same slot trade: here each slot's replicas are on one node, so none helps.
    assert trade_move({0: "A", 1: "B", 2: "A", 3: "B"}, 2, 2) is None
    # Nothing split, or a split group with no partner to trade with: no trade.
    assert trade_move({0: "A", 1: "A", 2: "B", 3: "B"}, 2, 2) is None
    assert trade_move({0: "A", 1: "B", 2: "C", 3: "C"}, 2, 2) is None
    # tp 4: rank 2 (slot 2) is group 0's only rank on B, rank 6 (slot 2) group 1's only one on A.
    assert trade_move({0: "A", 1: "A", 2: "B", 3: "A", 4: "B", 5: "B", 6: "A", 7: "B"}, 4, 4) == (2, 6)
    # A trade that gathers one group and leaves the other as split as it was still counts: 0 <-> 2
    # puts group 1 on A (1 <-> 3 would gather group 0 there, as good: the lower ranks win).
    assert trade_move({0: "A", 1: "B", 2: "C", 3: "A", 4: "C", 5: "C"}, 2, 2) == (0, 2)
    # A pipeline's slots (stage x tp index, 4 a replica): stage 0's tp groups of replicas 0 and 1
    # (ranks 0-1 and 4-5) cross A and C; rank 0 and rank 4 (both stage 0, tp index 0) trade.
    nodes = {0: "A", 1: "C", 2: "B", 3: "B", 4: "C", 5: "A", 6: "D", 7: "D"}
    assert trade_move(nodes, 2, 4) == (0, 4)
    assert trade_move({**nodes, 4: "A", 5: "C"}, 2, 4) is None  # stage 0 at tp 0 is on A in both: no help


def test_spares_start_a_tp_groups_worth_to_a_node():
    # Two spares for tp 2: both on one node, so a node kill that takes a whole tp group finds both there.
    assert spare_homes(2, 2, {"C": 1.0, "D": 1.0}, 0.5) == ["C", "C"]
    assert spare_homes(4, 2, {"C": 1.0, "D": 0.5, "E": 1.0}, 0.5) == ["C", "C", "E", "E"]
    # A node holding one ready spare of a pair is topped up first, even with less room than another.
    assert spare_homes(1, 2, {"C": 0.5, "D": 1.0}, 0.5, have=["C"]) == ["C"]
    assert spare_homes(1, 2, {"C": 0.5, "D": 1.0}, 0.5, have=["C", "C"]) == ["D"]  # C's pair is whole
    # No node holds a pair: as close as the room allows, then left to Ray.
    assert spare_homes(3, 2, {"C": 0.5, "D": 0.5}, 0.5) == ["C", "D"]
    assert spare_homes(2, 2, {}, 0.5) == []
