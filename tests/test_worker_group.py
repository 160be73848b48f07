"""Group formation and spare calibration against real Ray actors that answer slowly or not at all.

The members here speak the worker's formation protocol (join, ping, abort) without a
process group behind it, so the test can choose how late each one answers. What is checked is
WorkerGroup.form's rule: a member without a heartbeat is lost only after FORMATION_SILENCE x
ping_timeout_s without an answer; one with a heartbeat (its node agent's sidecar, elastic/runtime/heartbeat.py, a real one
watching the member's process here) is kept while its node says it runs, and lost after
ping_timeout_s once the node says it is stopped. Then the others' joins are cut at once (not left
to the rendezvous timeout)."""
from __future__ import annotations

import os
import signal
import threading
import time


import pytest
import ray

from elastic.config import JobConfig
from elastic.policies.failure import FORMATION_SILENCE
from elastic.group.worker_group import GroupError, Member, WorkerGroup
from elastic.protocol import AbortResult
from tests.ray_fixtures import one_node_ray

pytestmark = pytest.mark.timeout(120)

PING_TIMEOUT_S = 0.5


class FormationMember:
    """Joins after `join_s` unless its rendezvous is cut (abort); answers a ping after `ping_s`."""

    def __init__(self, ping_s: float, join_s: float, join_error: str | None = None):
        self.ping_s, self.join_s, self.join_error = ping_s, join_s, join_error
        self.cut = threading.Event()

    def where(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def join(self, addr, port, rank, world_size, generation, pp=1) -> None:
        if self.join_error:
            raise RuntimeError(self.join_error)
        if self.cut.wait(self.join_s):
            raise RuntimeError("rendezvous cut")

    def ping(self) -> bool:
        time.sleep(self.ping_s)
        return True

    def abort(self, generation: int) -> AbortResult:
        self.cut.set()
        return AbortResult(aborted=True, joining="waiting for the others at the rendezvous for 9.0 s")

    def calibrate(self) -> float:
        time.sleep(self.ping_s)
        return 0.25


@pytest.fixture(scope="module")
def local_ray():
    with one_node_ray(__name__):
        yield


def group_of(*members: tuple[float, float], heartbeat: bool = False) -> WorkerGroup:
    """Members without a heartbeat unless `heartbeat` (then `with_heartbeat` brings it up)."""
    job = JobConfig.model_validate({
        "run": {"name": "form", "num_steps": 1}, "scaling": {"num_workers": max(1, len(members))},
        "failure": {"heartbeat": heartbeat},
        "checkpoint": {"storage_uri": "memory://form"},
        "train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 48}})
    g = WorkerGroup(job, job.model_dump_json(), "memory://form", None, None)
    for r, (ping_s, join_s) in enumerate(members):
        g.members[r] = member(r, ping_s, join_s)
    return g


def member(rank: int, ping_s: float, join_s: float, join_error: str | None = None, **kw) -> Member:
    h = ray.remote(max_concurrency=4, num_cpus=0)(FormationMember).remote(ping_s, join_s, join_error)
    node_id, pid = ray.get(h.where.remote())
    return Member(rank, h, node_id, "127.0.0.1", pid, **kw)


def test_a_member_slow_to_answer_a_ping_still_forms_the_group(local_ray):
    # Rank 1 answers each ping 3x later than ping_timeout_s (a busy machine), well inside the bound.
    slow_ping = PING_TIMEOUT_S * 3
    assert slow_ping < PING_TIMEOUT_S * FORMATION_SILENCE
    g = group_of((0.0, 4.0), (slow_ping, 4.0))
    slowest = g.form(generation=1, timeout_s=60, ping_timeout_s=PING_TIMEOUT_S)
    assert slowest >= slow_ping


def test_a_silent_member_fails_formation_and_the_others_are_cut_loose(local_ray):
    # Rank 1 never answers and never joins (a stopped machine): rank 0's join would wait out
    # the 60 s rendezvous; instead rank 1 is found silent and rank 0's rendezvous is cut.
    g = group_of((0.0, 600.0), (600.0, 600.0))
    with pytest.raises(GroupError) as e:
        g.form(generation=1, timeout_s=60, ping_timeout_s=PING_TIMEOUT_S)
    assert e.value.ranks == {1: "unresponsive", 0: ("error: peer failed during formation (was waiting for the "
                                                    "others at the rendezvous for 9.0 s)")}


def test_a_member_whose_join_fails_cuts_the_others_at_once(local_ray):
    # Rank 1 answers its pings but its join raises at once: the others wait for it in vain, so
    # their joins are cut now, not at the rendezvous timeout (600 s here, past the test's bound).
    g = group_of((0.0, 600.0), (0.0, 600.0))
    g.members[1] = member(1, 0.0, 600.0, join_error="previous run() is still inside a collective")
    with pytest.raises(GroupError) as e:
        g.form(generation=1, timeout_s=600, ping_timeout_s=PING_TIMEOUT_S)
    assert e.value.ranks[1] == "error: RuntimeError: previous run() is still inside a collective"
    assert e.value.ranks[0].startswith("error: peer failed during formation")


def test_a_formation_every_member_answers_but_none_completes_says_where_each_was(local_ray):
    g = group_of((0.0, 600.0), (0.0, 600.0))
    with pytest.raises(GroupError) as e:
        g.form(generation=1, timeout_s=2.0, ping_timeout_s=PING_TIMEOUT_S)
    assert e.value.ranks == {r: ("error: did not join within failure.rendezvous_timeout_s=2 (was waiting for "
                                 "the others at the rendezvous for 9.0 s)") for r in (0, 1)}


def with_heartbeat(g: WorkerGroup, rank: int):
    """The members' node agent up, its heartbeat sidecar watching their processes (as the group's
    start brings it up), before the formation starts. Returns what stops it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and rank not in g.agents.heartbeat_targets(g.members):
        time.sleep(0.1)
    assert rank in g.agents.heartbeat_targets(g.members), "the node agent did not come up"
    return g.agents


def test_a_member_that_never_answers_a_ping_but_whose_node_says_it_runs_forms_the_group(local_ray):
    # Rank 1's pings wait 600 s (its Python busy) but it joins after 4 s, past the 5 x 0.5 s
    # poll-only bound: its heartbeat says the process sleeps, so it is waited for.
    assert 4.0 > PING_TIMEOUT_S * FORMATION_SILENCE
    g = group_of((0.0, 4.0), (600.0, 4.0), heartbeat=True)
    side = with_heartbeat(g, 1)
    try:
        g.form(generation=1, timeout_s=60, ping_timeout_s=PING_TIMEOUT_S)
    finally:
        side.shutdown()


def test_a_stopped_member_is_found_by_its_heartbeat_after_ping_timeout(local_ray):
    # ping_timeout_s 2 s and a 8 s rendezvous: polls alone would need 5 x 2 s, so the rendezvous
    # would time out first and every pending rank would be "unresponsive". The node's heartbeat
    # says rank 1 is stopped (state T), so it alone is lost after 2 s and rank 0's join is cut.
    g = group_of((0.0, 600.0), (600.0, 600.0), heartbeat=True)
    side = with_heartbeat(g, 1)
    os.kill(g.members[1].pid, signal.SIGSTOP)
    try:
        with pytest.raises(GroupError) as e:
            g.form(generation=1, timeout_s=8.0, ping_timeout_s=2.0)
    finally:
        os.kill(g.members[1].pid, signal.SIGKILL)
        side.shutdown()
    assert 8.0 < 2.0 * FORMATION_SILENCE
    assert e.value.ranks[1] == "unresponsive"
    assert e.value.ranks[0].startswith("error: peer failed during formation")


def test_spares_started_on_demand_are_calibrated_when_weighed_and_silent_ones_dropped(local_ray):
    g = group_of()
    calibrated = member(-1, 0.0, 0.0, calib_s=0.1)
    fresh = member(-1, 0.0, 0.0, on_demand=True)  # warmed, not calibrated
    silent = member(-1, 600.0, 0.0, on_demand=True)  # its calibration never answers
    g.ready_spares = [calibrated, fresh, silent]
    lost = g.calibrate_spares(timeout_s=2.0)
    assert g.ready_spares == [calibrated, fresh]
    assert calibrated.calib_s == 0.1 and fresh.calib_s == 0.25
    assert lost == [f"spare on node {silent.node_id[:12]} unresponsive when calibrated"]
    assert g.calibrate_spares(timeout_s=2.0) == []  # nothing left to calibrate
