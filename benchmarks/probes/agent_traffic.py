"""The controller's periodic traffic on a real cluster, with node agents:
`python -m benchmarks.probes.agent_traffic [STEPS]`.

DDP over 4 ranks on a local cluster of 2 nodes with 2 CPUs each (2 ranks per node), the overhead
benchmark's 1.3 M MLP, then the same 4 ranks on 4 one-CPU nodes. Each run's `run_finished` event
counts what the group sent: aggregated polls to the nodes' agents, polls sent to ranks directly
(before their node's agent was up) and heartbeat pings. Prints them per second of the run, beside
the ranks and nodes: with agents, polls and pings follow the nodes, not the ranks."""
from __future__ import annotations

import json
import sys
import tempfile
import uuid


def job(root: str, num_steps: int) -> dict:
    return {"run": {"name": f"traffic-{uuid.uuid4().hex[:6]}", "num_steps": num_steps, "seed": 0},
            "scaling": {"num_workers": 4},
            "checkpoint": {"storage_uri": root, "every_steps": 100_000},
            "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                      "loss": "elastic.workload:loss_fn", "global_batch_size": 64}}


def main(num_steps: int) -> int:
    from elastic import Trainer
    from elastic.local_cluster import local_cluster
    for nodes, cpus in ((2, 2), (4, 1)):
        with local_cluster(num_worker_nodes=nodes, cpus_per_node=cpus, dashboard=False):
            result = Trainer(job("file://" + tempfile.mkdtemp(), num_steps)).fit(progress=False)
        (fin,) = result.events_of("run_finished")
        started = result.events_of("group_formed")[0]["t"]
        run_s = fin["t"] - started
        traffic = fin["control_traffic"]
        print(json.dumps({"ranks": 4, "nodes": nodes, "steps": fin["step"], "run_s": round(run_s, 1),
                          **traffic, **{f"{k}_per_s": round(v / run_s, 1) for k, v in traffic.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 400))
