"""`elastic bench recovery`: the common workload with rank 1's node killed (`--fault kill_node`)
or frozen (`--fault freeze_node`: SIGSTOP, no socket closes, as a machine that loses power) at a
fixed step, elastic and Ray Train side by side on the same local cluster, interleaved per
repetition.

Figures (shared/BENCHMARKS.md): recover_s (fault -> first step completed by the recovered
group), lost_steps (steps done before the fault that were done again), detect_s (fault ->
the framework decided/noticed). On a user's own cluster the same code runs with --address.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
import uuid

from elastic.bench.output import emit, medians, parse_systems, report_against_peer

NUM_WORKERS, NUM_STEPS, FAULT_STEP, CKPT_EVERY, GLOBAL_BATCH = 3, 40, 25, 10, 96
METRICS = ["recover_s", "lost_steps", "detect_s"]


# elastic's recovery paths, each a system of its own in the table.
ELASTIC_SYSTEMS = {
    "elastic-storage": ({"num_workers": NUM_WORKERS}, {"peer_restore": False}),  # reload from storage
    "elastic": ({"num_workers": NUM_WORKERS}, {}),  # survivors' memory + a worker started on demand
    "elastic-spare": ({"num_workers": NUM_WORKERS, "num_spares": 1, "wait_for_spares": True}, {}),  # warm spare
}
SYSTEMS = [*ELASTIC_SYSTEMS, "ray-train"]


def elastic_job(system: str, storage_uri: str, storage_options: dict, fault: str = "kill_node") -> dict:
    scaling, failure = ELASTIC_SYSTEMS[system]
    return {
        "run": {"name": f"bench-recovery-{uuid.uuid4().hex[:8]}", "num_steps": NUM_STEPS, "seed": 0},
        "scaling": scaling,
        "failure": {"max_failures": 3, **failure},
        "checkpoint": {"storage_uri": storage_uri, "storage_options": storage_options, "every_steps": CKPT_EVERY},
        "train": {"model": "elastic.bench.workload:build_model", "dataset": "elastic.bench.workload:build_dataset",
                  "loss": "elastic.bench.workload:loss_fn", "optimizer": "elastic.bench.workload:build_optimizer",
                  "global_batch_size": GLOBAL_BATCH},
        "chaos": [{"action": fault, "rank": 1, "at_step": FAULT_STEP}],
    }


def run_elastic(system: str, storage_uri: str, storage_options: dict, fault: str) -> dict:
    from elastic import Trainer
    t0 = time.time()
    result = Trainer(elastic_job(system, storage_uri, storage_options, fault)).fit(progress=False)
    rec = result.events_of("recovered")
    r = rec[0] if rec else {}
    restored = result.events_of("restored")[-1]
    return {"bench": "recovery", "system": system, "fault": fault, "recover_s": r.get("recover_s"),
            "restore_source": restored["source"],
            "lost_steps": r.get("lost_steps"), "detect_s": r.get("detect_s"), "fault_step": r.get("fault_step"),
            "resumed_step": r.get("resumed_step"), "final_step": result.metrics["step"],
            "total_s": time.time() - t0, "num_workers": NUM_WORKERS, "ckpt_every": CKPT_EVERY,
            "replicas_identical": len(set(result.digests.values())) == 1, "run_dir": result.run_dir}


def run_ray_train(storage_dir: str, fault: str) -> dict:
    from elastic.bench.ray_train_peer import run_ray_train_recovery
    return run_ray_train_recovery(storage_dir=storage_dir, num_workers=NUM_WORKERS, num_steps=NUM_STEPS,
                                  fault_step=FAULT_STEP, ckpt_every=CKPT_EVERY, global_batch_size=GLOBAL_BATCH,
                                  fault=fault)


def main(args) -> int:
    from elastic.bench.local_cluster import local_cluster

    systems = parse_systems("recovery", args.systems, list(SYSTEMS))
    if systems is None:
        return 2
    faults = [f.strip() for f in args.fault.split(",") if f.strip()]
    if not faults or set(faults) - {"kill_node", "freeze_node"}:
        print(f"elastic bench recovery: --fault: expected kill_node, freeze_node or both (comma-separated), "
              f"got {args.fault!r}", file=sys.stderr)
        return 2
    if args.storage == "s3" and "ray-train" in systems:
        print("note: ray-train checkpoints to local disk; only elastic uses s3 in this run", file=sys.stderr)
    records: list[dict] = []
    work = tempfile.mkdtemp(prefix="elastic-bench-")
    with contextlib.ExitStack() as stack:
        storage_uri, storage_options = "file://" + os.path.join(work, "runs"), {}
        if args.storage == "s3":
            from elastic.testing.seaweedfs import seaweedfs_server
            s3 = stack.enter_context(seaweedfs_server())
            storage_uri, storage_options = f"{s3.uri}/bench", s3.storage_options
        cluster = stack.enter_context(local_cluster(num_worker_nodes=NUM_WORKERS + 1, cpus_per_node=1))
        for rep in range(args.reps):
            for fault in faults:
                for system in systems:  # interleaved, so drift on a shared machine hits all alike
                    cluster.ensure_worker_nodes(NUM_WORKERS + 1)
                    if system == "ray-train":
                        rec = {**run_ray_train(work, fault), "storage": "file"}
                    else:
                        rec = {**run_elastic(system, storage_uri, storage_options, fault), "storage": args.storage}
                    rec["rep"] = rep
                    records.append(rec)
                    emit(rec)
    for fault in faults:
        mine = [r for r in records if r["fault"] == fault]
        med = medians(mine, METRICS)
        notes = [f"{NUM_WORKERS} workers + 1 spare node (local ray.cluster_utils.Cluster, 1 CPU each), "
                 f"MLP 1.3M params, global batch {GLOBAL_BATCH}, checkpoint every {CKPT_EVERY} steps, "
                 f"rank 1's node {'killed' if fault == 'kill_node' else 'frozen (SIGSTOP)'} after step {FAULT_STEP}"]
        report_against_peer("recovery", f"recovery ({fault})", mine, med, METRICS, list(ELASTIC_SYSTEMS),
                            "ray-train", notes, args.out)
    return 0
