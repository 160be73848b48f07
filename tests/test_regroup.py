"""Gathering a split tp group (elastic/controller/regroup.py), against a fake group: which warm
spare may take a rank of the group back beside the rest of it while stragglers are watched."""
from __future__ import annotations

import math
import uuid

import pytest

from elastic.config import JobConfig
from elastic.controller import regroup
from elastic.controller.controller import Controller
from elastic.controller.states import Swapping
from tests.support.fake_group import FakeClock, FakeGroup, FakeRank

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
