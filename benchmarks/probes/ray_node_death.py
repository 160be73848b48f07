"""How long Ray (default health checks) takes to declare a partitioned node dead: a Ray node in its
own network namespace (tests.support.netns) has its link cut like a pulled cable, and `ray.nodes()`
is polled every 0.2 s until it reports the node dead. A measurement of Ray, not a behaviour of
elastic (which finds a silent rank by its heartbeat in seconds): docs/partition.md#measured.

    flock /tmp/elastic-ray.lock python -m benchmarks.probes.ray_node_death   (root, iproute2)
"""
from __future__ import annotations

import sys

from tests.support import netns


def main() -> int:
    reason = netns.netns_unsupported_reason()
    if reason:
        print(f"ray_node_death: {reason}", file=sys.stderr)
        return 2
    with netns.partition_cluster(num_normal_nodes=1, num_isolated_nodes=1, cpus_per_node=1) as pc:
        iso = pc.isolated_node_ready()
        iso.cut()
        took = netns.wait_node_dead(iso.node_id, timeout_s=240)
        print(f"ray.nodes() reported the cut node dead {took} s after the cut" if took is not None
              else "Ray did not declare the cut node dead within 240 s")
        iso.close()
    return 0 if took is not None else 1


if __name__ == "__main__":
    sys.exit(main())
