"""The spare pool against a real multi-node Ray cluster: a spare that waits for a free slot waits
at one node's raylet, and when that node stops, the pool starts it again elsewhere instead of
waiting for Ray to declare the node dead (elastic/group/spares.py, `_restart_stranded`)."""
from __future__ import annotations

import sys
import time

import pytest
import ray
from ray import cloudpickle

from elastic.config import JobConfig
from elastic.group.room import placing_node
from elastic.group.worker_group import WorkerGroup
from tests.ray_fixtures import cluster, ray_cluster  # noqa: F401

pytestmark = pytest.mark.timeout(240)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the Blocker class needs no import on the workers


@ray.remote(num_cpus=1)
class Blocker:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def _until(what, limit_s: float = 60.0):
    """Poll `what()` until it returns something truthy (a guard against a hang, not a timing check)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {limit_s} s: {what}")


def test_a_spare_waiting_at_a_node_that_stops_is_started_again_on_a_node_that_joins(cluster):  # noqa: F811
    nodes = {n.node_id: n for n in cluster.cluster.worker_nodes if cluster.node_usable(n)}
    blockers = [Blocker.options(scheduling_strategy="SPREAD").remote() for _ in nodes]
    assert sorted(ray.get([b.node.remote() for b in blockers])) == sorted(nodes)  # every slot taken
    job = JobConfig.model_validate({
        "run": {"name": "pool", "num_steps": 1}, "scaling": {"num_workers": 1, "num_spares": 1},
        "checkpoint": {"storage_uri": "memory://pool"},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": 48}})
    group = WorkerGroup(job, job.model_dump_json(), "memory://pool", None, None)
    try:
        group.add_spares(1, background=True)
        (first,) = group._pending_spares.values()
        waits_at = _until(lambda: (n := placing_node(first)) in nodes and n)  # queued at a full node's raylet

        cluster.freeze_node(nodes[waits_at])  # a machine that stops: Ray still lists it alive for a while
        group.suspect(waits_at)
        assert [w for w in group.lost_spares if "started again" in w and waits_at[:12] in w], group.lost_spares
        (second,) = group._pending_spares.values()
        assert second is not first
        new = cluster.add_worker_node()
        assert group.wait_spares_ready(90.0), "the restarted spare never became ready"
        (spare,) = group.ready_spares
        assert spare.node_id == new.node_id  # the only free slot: on the node that joined
    finally:
        for h in [*blockers, *(m.handle for m in group.ready_spares), *group._pending_spares.values()]:
            ray.kill(h, no_restart=True)
