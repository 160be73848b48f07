"""Node agents (elastic/group/node_agent.py) against real Ray actors: the group's polls go one per
node through the agent, and what the run loop reads per rank (answers, silence, deaths, the
heartbeat) is what it read when it polled each rank itself.

The members are stand-ins that answer `poll()` with a numbered PollReport (each answer once, as a
worker reports its persists once), so a lost or doubled answer shows."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import ray

from elastic.config import JobConfig
from elastic.group.worker_group import Member, WorkerGroup
from elastic.protocol import PollReport, RankStatus
from tests.ray_fixtures import one_node_ray

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")]

PING_TIMEOUT_S = 1.0


class PollMember:
    """Answers poll() with its next number in `step` (each number once); `hold` blocks its polls
    (its Python busy) until released."""

    def __init__(self, rank: int):
        self.rank, self.n = rank, 0
        self.free = threading.Event()
        self.free.set()

    def where(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def poll(self) -> PollReport:
        self.free.wait()
        self.n += 1
        return PollReport(rank=self.rank, generation=None, status=RankStatus.RUNNING, step=self.n)

    def hold(self, on: bool) -> None:
        self.free.clear() if on else self.free.set()


@pytest.fixture(scope="module")
def local_ray():
    with one_node_ray(__name__):
        yield


@pytest.fixture
def group(local_ray):
    job = JobConfig.model_validate({
        "run": {"name": "agents", "num_steps": 1}, "scaling": {"num_workers": 4},
        "checkpoint": {"storage_uri": "memory://agents"},
        "train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 48}})
    g = WorkerGroup(job, job.model_dump_json(), "memory://agents", None, None)
    for r in range(4):
        h = ray.remote(max_concurrency=4, num_cpus=0)(PollMember).remote(r)
        node_id, pid = ray.get(h.where.remote())
        g.members[r] = Member(r, h, node_id, "127.0.0.1", pid)
    yield g
    g.shutdown()


def poll_until(g: WorkerGroup, done, limit_s: float = 30.0) -> tuple[dict, dict]:
    """Poll as the run loop does (every 0.05 s here) until `done(answers so far, silent)`; real
    time bounds only the wait for Ray's calls."""
    seen: dict[int, list[int]] = {}
    silent: dict[int, str] = {}
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        answers, quiet = g.poll_nowait(PING_TIMEOUT_S)
        for r, a in answers.items():
            seen.setdefault(r, []).append(a.step)
        silent.update(quiet)
        if done(seen, silent):
            break
        time.sleep(0.05)
    return seen, silent


def test_polls_go_one_per_node_through_its_agent_and_lose_no_answer(group):
    # Until the agent is up the ranks are polled directly; then every poll goes through it.
    seen, _ = poll_until(group, lambda s, _: group.agents.rpcs >= 20 and all(len(s.get(r, ())) >= 5 for r in range(4)))
    traffic = group.control_traffic()
    assert traffic["agent_polls"] >= 20
    direct_before = traffic["direct_polls"]
    assert direct_before <= 4 * 60  # only while the agent started
    for r in range(4):  # every answer once, in order: none lost or doubled in the hand-over
        assert seen[r] == list(range(1, len(seen[r]) + 1))
    seen2, _ = poll_until(group, lambda s, _: all(len(s.get(r, ())) >= 10 for r in range(4)))
    assert group.control_traffic()["direct_polls"] == direct_before  # no direct poll once the agent is up
    for r in range(4):
        assert seen2[r] == list(range(seen[r][-1] + 1, seen[r][-1] + 1 + len(seen2[r])))


def test_a_busy_rank_is_unanswered_then_silent_and_its_answer_comes_back(group):
    poll_until(group, lambda s, _: group.agents.rpcs >= 5 and len(s) == 4)
    ray.get(group.members[2].handle.hold.remote(True))
    _, silent = poll_until(group, lambda _, q: 2 in q)
    assert silent == {2: "unresponsive"}
    assert group.unanswered_s()[2] > PING_TIMEOUT_S
    ray.get(group.members[2].handle.hold.remote(False))
    seen, _ = poll_until(group, lambda s, _: 2 in s)
    assert 2 in seen and 2 not in group.unanswered_s()


def test_a_dead_rank_is_reported_with_its_cause_through_the_agent(group):
    poll_until(group, lambda s, _: group.agents.rpcs >= 5 and len(s) == 4)
    ray.kill(group.members[1].handle, no_restart=True)
    _, silent = poll_until(group, lambda _, q: 1 in q)
    assert silent[1] == "process_died"
    assert set(silent) == {1}


def test_the_agents_death_is_its_nodes_ranks_loss(group):
    poll_until(group, lambda s, _: group.agents.rpcs >= 5 and len(s) == 4)
    agent_pid = group.agents.info(group.members[0].node_id).pid
    os.kill(agent_pid, signal.SIGKILL)
    _, silent = poll_until(group, lambda _, q: len(q) == 4)
    assert silent == {r: "process_died" for r in range(4)}
    assert "its agent died" in group.agents.lost[group.members[0].node_id]


def test_the_last_answers_in_flight_at_the_agent_are_drained(group):
    before, _ = poll_until(group, lambda s, _: group.agents.rpcs >= 5 and len(s) == 4)
    ray.get(group.members[3].handle.hold.remote(True))
    seen, _ = poll_until(group, lambda s, _: group.unanswered_s().get(3, 0) > 0.3)
    last = (seen.get(3) or before[3])[-1]
    threading.Timer(0.5, lambda: group.members[3].handle.hold.remote(False)).start()
    drained = group.drain_polls(timeout_s=10)
    assert drained[3].step == last + 1  # the poll held at the agent, answered and not lost


def test_the_nodes_heartbeat_comes_from_its_agent_for_every_rank(group):
    poll_until(group, lambda s, _: group.agents.rpcs >= 2)
    deadline = time.monotonic() + 20
    beats = {}
    while time.monotonic() < deadline and len(beats) < 4:
        beats = group.beats()
        time.sleep(0.1)
    assert set(beats) == {0, 1, 2, 3} and all(b.state in "SR" for b in beats.values())
    os.kill(group.members[2].pid, signal.SIGSTOP)
    try:
        while time.monotonic() < deadline and group.beats()[2].state != "T":
            time.sleep(0.1)
        beats = group.beats()
        assert beats[2].state == "T" and beats[0].state in "SR"
    finally:
        os.kill(group.members[2].pid, signal.SIGCONT)
    # One ping per round to the one node's sidecar, not one per rank (4 here).
    assert group.heartbeats.pings_sent == group.heartbeats.rounds > 0
