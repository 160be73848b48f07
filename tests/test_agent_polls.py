"""The group's side of the node agents' aggregated polls, without Ray: how the nodes' answers
(`NodePoll`) become per-rank answers, silences and waits (`NodeAgents.settle`, `unanswered_s`).
A rank's wait is its node's poll's unless its agent says it still waits on it."""
from __future__ import annotations

import time

import pytest

from elastic.group.member import Member, Members
from elastic.group.node_agent import NodeAgents
from elastic.protocol import NodePoll, PollReport, RankStatus

pytestmark = pytest.mark.timeout(60)
TIMEOUT_S = 1.0


class _Handle:
    def __init__(self, i: int):
        self._actor_id = bytes.fromhex(f"{i:032x}")


def two_nodes():
    """Ranks 0-3 on node a, 4-7 on node b, as the last `sync` left the agents."""
    members = Members({r: Member(r, _Handle(r), "a" if r < 4 else "b", "10.0.0.1", 1000 + r) for r in range(8)})
    agents = NodeAgents(heartbeat_on=False)
    for node, ranks in (("a", range(4)), ("b", range(4, 8))):
        agents._by_node[node] = list(ranks)
        agents._told[node] = {r: members[r].actor_hex for r in ranks}
        agents._node_of.update(dict.fromkeys(ranks, node))
    agents._sync_key = (members.version, agents.epoch, 0)
    return agents, members


def reply(members, answered, waiting=None, died=None):
    return NodePoll(epoch=0, actors={r: members[r].actor_hex for r in [*answered, *(died or {})]},
                    answers={r: PollReport(rank=r, generation=1, status=RankStatus.RUNNING, step=3) for r in answered},
                    died=died or {}, waiting_s=waiting or {})


def settle(agents, members, replies, now):
    answers, silent = {}, {}
    agents.settle(replies, members, now, TIMEOUT_S, answers, silent)
    return answers, silent


def test_every_rank_answered_is_folded_in_and_waits_on_nothing():
    agents, members = two_nodes()
    now = time.monotonic()
    answers, silent = settle(agents, members, [("a", now - 0.1, reply(members, range(4))),
                                               ("b", now - 0.3, reply(members, range(4, 8)))], now)
    assert sorted(answers) == list(range(8)) and silent == {}
    assert agents.slowest_answer_s >= 0.3
    assert agents.unanswered_s().get(2) is None  # no poll of its in flight


def test_a_node_whose_poll_goes_unanswered_makes_all_its_ranks_silent():
    agents, members = two_nodes()
    now = time.monotonic()
    agents._polls["b"] = (object(), now - 0.5)  # b's poll in flight
    answers, silent = settle(agents, members, [("a", now - 0.1, reply(members, range(4)))], now)
    assert sorted(answers) == [0, 1, 2, 3] and silent == {}
    assert agents.unanswered_s()[5] == pytest.approx(0.5, abs=0.1)
    agents._polls["b"] = (object(), now - TIMEOUT_S - 0.1)
    _, silent = settle(agents, members, [], now)
    assert silent == dict.fromkeys(range(4, 8), "unresponsive")


def test_a_rank_its_agent_still_waits_on_keeps_its_own_wait_until_it_answers():
    agents, members = two_nodes()
    now = time.monotonic()
    answers, silent = settle(agents, members, [("a", now - 0.2, reply(members, [0, 1, 2], waiting={3: 0.6}))], now)
    assert 3 not in answers and silent == {}
    agents._polls["a"] = (object(), now)  # the next poll went out: rank 3's wait is still its own
    assert agents.unanswered_s()[3] == pytest.approx(0.6, abs=0.1)
    assert agents.unanswered_s()[0] == pytest.approx(0.0, abs=0.1)
    _, silent = settle(agents, members, [], now + 0.5)
    assert silent == {3: "unresponsive"}
    del agents._polls["a"]
    answers, silent = settle(agents, members, [("a", now, reply(members, [3]))], now + 0.6)
    assert 3 in answers and silent == {} and agents.unanswered_s().get(3) is None
    assert agents.slowest_answer_s >= 0.6  # its answer waited since before the poll it answered


def test_an_answer_from_a_ranks_former_worker_is_dropped():
    agents, members = two_nodes()
    members[2] = Member(2, _Handle(99), "a", "10.0.0.1", 1099)  # replaced since the last sync
    now = time.monotonic()
    answers, silent = settle(agents, members, [("a", now, reply(two_nodes()[1], range(4)))], now)
    assert sorted(answers) == [0, 1, 3] and silent == {}


def test_a_rank_its_agent_was_not_told_of_yet_waits_from_the_poll_and_a_death_is_said():
    agents, members = two_nodes()
    now = time.monotonic()
    answers, silent = settle(agents, members, [("a", now - 0.4, reply(members, [0, 1], died={2: "process_died"}))], now)
    assert sorted(answers) == [0, 1] and silent == {2: "process_died"}
    assert agents.unanswered_s()[3] == pytest.approx(0.4, abs=0.1)  # neither answered nor waited on
    _, silent = settle(agents, members, [], now + TIMEOUT_S)
    assert silent == {3: "unresponsive"}
