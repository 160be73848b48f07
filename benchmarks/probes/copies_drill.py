"""How many steps a node kill costs FSDP with in-memory copies at their default budget, against
the storage path: `python -m benchmarks.probes.copies_drill [HIDDEN ...]`.

FSDP over 3 ranks on a local cluster (head + 4 one-CPU nodes), the overhead benchmark's MLP
(`hidden` wide: 1024 is 1.3 M parameters, 3072 is 10.3 M), checkpoints every 50 steps, the node of
rank 1 killed after step 70 (20 steps after the last checkpoint). Once with the copies as
configured by default (checkpoint.memory_every_steps 1, memory_max_overhead 0.03), once with them
off. Prints, per run, where the state came from and the steps redone."""
from __future__ import annotations

import json
import sys
import tempfile
import uuid

NUM_STEPS, EVERY, FAULT_STEP = 100, 50, 70


def job(root: str, copies: bool) -> dict:
    return {"run": {"name": f"drill-{uuid.uuid4().hex[:6]}", "num_steps": NUM_STEPS, "seed": 0},
            "scaling": {"num_workers": 3},
            "checkpoint": {"storage_uri": root, "every_steps": EVERY, "memory_every_steps": 1 if copies else 0},
            "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                      "loss": "elastic.workload:loss_fn", "global_batch_size": 96, "strategy": "fsdp"},
            "chaos": [{"action": "kill_node", "rank": 1, "at_step": FAULT_STEP}]}


def main(widths: list[int]) -> int:
    import ray

    from elastic import Trainer
    from elastic.local_cluster import local_cluster
    from benchmarks.overhead import num_params
    from elastic.workload import HIDDEN_ENV
    with local_cluster(num_worker_nodes=4, cpus_per_node=1) as cluster:
        for hidden in widths:
            ray.shutdown()
            ray.init(address=cluster.address, runtime_env={"env_vars": {HIDDEN_ENV: str(hidden)}}, log_to_driver=False)
            for copies in (True, False):
                cluster.ensure_worker_nodes(4)
                result = Trainer(job("file://" + tempfile.mkdtemp(), copies)).fit(progress=False)
                (plan,) = result.events_of("restore_plan")
                (rec,) = result.events_of("recovered")
                print(json.dumps({"params": num_params(hidden), "copies": copies, "source": plan["source"],
                                  "reason": plan["reason"], "resumed_step": rec["resumed_step"],
                                  "lost_steps": rec["lost_steps"], "recover_s": round(rec["recover_s"], 2)}),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main([int(x) for x in sys.argv[1:]] or [1024, 3072]))
