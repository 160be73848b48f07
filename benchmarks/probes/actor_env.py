"""How long a Ray actor takes from being asked for to its constructor, with and without a runtime
environment of its own (an env var): an actor with one cannot use the Python processes Ray keeps
started, and starts one (elastic/group/runtime_env.py). Three one-CPU actors at once on a local
cluster of three one-CPU nodes, alternating, REPS times each.

    flock /tmp/elastic-ray.lock python -m benchmarks.probes.actor_env [REPS]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import ray

from elastic.local_cluster import local_cluster


class Probe:
    def __init__(self, asked_at: float):
        self.took = time.time() - asked_at

    def took_s(self) -> float:
        return self.took


def main(reps: int = 3) -> int:
    remote = ray.remote(Probe)
    envs = {"none": None, "env_vars": {"env_vars": {"PYTHONPATH": os.getcwd()}}}
    out: dict[str, list[float]] = {k: [] for k in envs}
    with local_cluster(num_worker_nodes=3, cpus_per_node=1, dashboard=False):
        for _ in range(reps):
            for name, env in envs.items():
                t0 = time.time()
                hs = [remote.options(num_cpus=1, scheduling_strategy="SPREAD", runtime_env=env).remote(t0)
                      for _ in range(3)]
                took = ray.get([h.took_s.remote() for h in hs])
                out[name] += took
                print(f"{name:9s} {' '.join(f'{t:.2f}' for t in took)} s")
                for h in hs:
                    ray.kill(h)
                time.sleep(3)  # Ray starts processes for its pool again
    for name, ts in out.items():
        print(f"{name:9s} median {statistics.median(ts):.2f} s over {len(ts)} actors")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:])))
