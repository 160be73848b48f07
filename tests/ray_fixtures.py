"""Pytest fixtures for real multi-node Ray tests (import them from conftest.py).

One local cluster per test module, because starting five Ray nodes costs
~15 s on a small machine; each test gets it topped up to 4 worker nodes, since
the previous test may have killed some (chaos).

Only one Ray cluster may run on a machine at a time; run these tests under
`flock /tmp/elastic-ray.lock`.
"""
from __future__ import annotations

from typing import Iterator

import pytest

from elastic.bench.local_cluster import LocalCluster, local_cluster

NUM_WORKER_NODES = 4  # 3 training workers + 1 spare node, as in the benchmarks


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalCluster]:
    with local_cluster(num_worker_nodes=NUM_WORKER_NODES, cpus_per_node=1) as cluster:
        yield cluster


@pytest.fixture
def cluster(ray_cluster: LocalCluster) -> LocalCluster:
    ray_cluster.ensure_worker_nodes(NUM_WORKER_NODES)
    return ray_cluster
