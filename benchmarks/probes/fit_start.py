"""Where a small run's wall time goes on a local cluster: a 3-rank, 20-step run of the workload's
MLP, twice on one cluster of 3 one-CPU nodes, each printed as its events' times from `run_started`
(and how long fit() took before the first one: the controller's start). For the start-up cost
every run pays, and every test that runs one (docs/architecture.md).

    flock /tmp/elastic-ray.lock python -m benchmarks.probes.fit_start [REPS]
"""
from __future__ import annotations

import sys
import tempfile
import time
import uuid

from elastic import Trainer
from elastic.local_cluster import local_cluster
from elastic.observability.events import parse_lines

KINDS = ("run_started", "workers_started", "group_formed", "restored", "checkpoint_committed", "final_state",
         "run_finished")


def job(root: str) -> dict:
    return {"run": {"name": f"fit-{uuid.uuid4().hex[:6]}", "num_steps": 20, "seed": 0},
            "scaling": {"num_workers": 3},
            "checkpoint": {"storage_uri": f"{root}/runs", "every_steps": 10},
            "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                      "loss": "elastic.workload:loss_fn", "optimizer": "elastic.workload:build_optimizer",
                      "global_batch_size": 12}}


def main(reps: int = 2) -> int:
    t0 = time.time()
    with local_cluster(num_worker_nodes=3, cpus_per_node=1):
        print(f"cluster up in {time.time() - t0:.1f} s")
        for rep in range(reps):
            root = tempfile.mkdtemp(prefix="elastic-fit-start-")
            j = job(root)
            start = time.time()
            Trainer(j).fit(progress=False)
            took = time.time() - start
            path = f"{root}/runs/{j['run']['name']}/events.jsonl"
            with open(path) as f:
                events = parse_lines(f.read(), path)
            first = events[0]["t"]
            print(f"run {rep}: fit() {took:.1f} s; first event {first - start:.2f} s after fit() began")
            for e in events:
                if e["kind"] in KINDS:
                    print(f"  {e['t'] - first:6.2f} s  {e['kind']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:])))
