"""Pytest fixtures for real multi-node Ray tests (import them from conftest.py).

One local cluster per test module, because starting five Ray nodes costs
~15 s on a small machine; each test gets it topped up to 4 worker nodes, since
the previous test may have killed some (chaos).

Only one Ray cluster may run on a machine at a time; run these tests under
`flock /tmp/elastic-ray.lock`.
"""
from __future__ import annotations

import contextlib
import socket
import sys
from typing import Iterator

import pytest

from elastic.local_cluster import LocalCluster, local_cluster

NUM_WORKER_NODES = 4  # 3 training workers + 1 spare node, as in the benchmarks


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalCluster]:
    with local_cluster(num_worker_nodes=NUM_WORKER_NODES, cpus_per_node=1, dashboard=False) as cluster:
        yield cluster


@pytest.fixture
def cluster(ray_cluster: LocalCluster) -> LocalCluster:
    ray_cluster.ensure_worker_nodes(NUM_WORKER_NODES)
    ray_cluster.wait_quiet()  # the last test's CPUs back and its killed nodes declared dead
    return ray_cluster


@contextlib.contextmanager
def one_node_ray(module_name: str) -> Iterator[None]:
    """A one-node Ray of the test module's own (`address="local"`, even where another runs), with
    the module's classes pickled by value so its stand-in actors need no import on the workers."""
    import ray
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[module_name])
    ray.init(address="local", num_cpus=2, log_to_driver=False, include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[module_name])


def assert_exact_once(ledger_path, num_steps: int, global_batch: int, num_samples: int, seed: int,
                      lost_rank_upto: tuple[int, int] | None = None) -> None:
    """The sample ledger of a run: every step trained on exactly the global batch the sample order
    prescribes (whatever the world size was), so every sample of every epoch was seen exactly once.

    `lost_rank_upto=(rank, step)`: that rank's process was killed after `step`; its reports not yet
    polled died with it. The controller completes those steps from the plan and marks the slices
    `derived`: only that rank's, only up to the fault, may be."""
    import json
    from collections import Counter

    from elastic.data.order import GlobalOrder

    ledger = json.loads(open(ledger_path).read())
    order = GlobalOrder(num_samples, seed)
    assert sorted(map(int, ledger)) == list(range(1, num_steps + 1)), "a step is missing from the ledger"
    seen: Counter = Counter()
    for step_done in range(1, num_steps + 1):
        entry = ledger[str(step_done)]
        s = step_done - 1  # the ledger is keyed by steps completed
        expected = order.indices(s * global_batch, (s + 1) * global_batch)
        per_rank = global_batch // entry["world_size"]
        assert sorted(map(int, entry["ranks"])) == list(range(entry["world_size"])), f"step {step_done}: a rank is missing"
        for r in map(int, entry.get("derived", [])):
            assert lost_rank_upto and r == lost_rank_upto[0] and step_done <= lost_rank_upto[1], \
                f"step {step_done}: rank {r}'s slice derived, but its report should be there"
        for r in range(entry["world_size"]):
            want = expected[r * per_rank:(r + 1) * per_rank]
            got = entry["ranks"][str(r)]
            assert got == want, f"step {step_done} rank {r}"
            for k, i in enumerate(got):
                seen[((s * global_batch + r * per_rank + k) // num_samples, i)] += 1
    assert all(c == 1 for c in seen.values())
    full_epochs = num_steps * global_batch // num_samples
    for e in range(full_epochs):
        assert sum(1 for (ep, _) in seen if ep == e) == num_samples


_given: set[int] = set()


def free_port() -> int:
    """A free port never handed out before in this process: ports picked one at a time are free
    when picked, but the kernel may pick a just-closed one again (two Ray components were once
    given the same port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port
