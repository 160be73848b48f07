"""`elastic bench resize`: a node joins a running job, the group grows from 2 to 3 ranks.

Figure (shared/BENCHMARKS.md): resize_s, from the resize decision to the first
step completed at the new world size. Systems, interleaved per repetition, each
on a fresh local cluster that starts with exactly 2 one-CPU worker nodes (a
third is added once the run has committed a checkpoint):

  elastic-memory   FSDP; every old rank offers its shards, the new group
                   re-shards them in memory (no storage read, no step redone)
  elastic-storage  FSDP with failure.peer_restore off: the old group checkpoints
                   the stop step, the new group loads it (DCP re-shards on load)
  ray-train        Ray Train's elastic ScalingConfig(num_workers=(2, 3)): the
                   whole group is stopped and restarted from its last checkpoint

Ray Train considers a resize once per `elastic_resize_monitor_interval_s`
(default 60 s); the bench sets it to 5 s so runs stay short. That interval, and
how late each system notices the node, is in `from_node_s` (node registered ->
first step at the new size), not in resize_s.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import uuid

from elastic.bench.output import emit, medians, parse_systems, report_against_peer

MIN, MAX, NUM_STEPS, CKPT_EVERY, GLOBAL_BATCH = 2, 3, 300, 10, 96
RAY_TRAIN_STEPS, RAY_TRAIN_MONITOR_S = 300, 5.0
GROW_AFTER_STEP = 20  # the node is added once a checkpoint at or after this step is committed
SYSTEMS = ["elastic-memory", "elastic-storage", "ray-train"]
METRICS = ["resize_s", "restore_s", "lost_steps", "from_node_s"]


def elastic_job(system: str, storage_uri: str) -> dict:
    return {
        "run": {"name": f"bench-resize-{uuid.uuid4().hex[:8]}", "num_steps": NUM_STEPS, "seed": 0},
        "scaling": {"num_workers": MIN, "min_workers": MIN, "max_workers": MAX, "grow_check_s": 1.0},
        "failure": {"max_failures": 2, "peer_restore": system == "elastic-memory"},
        "checkpoint": {"storage_uri": storage_uri, "every_steps": CKPT_EVERY},
        "train": {"model": "elastic.bench.workload:build_model", "dataset": "elastic.bench.workload:build_dataset",
                  "loss": "elastic.bench.workload:loss_fn", "optimizer": "elastic.bench.workload:build_optimizer",
                  "global_batch_size": GLOBAL_BATCH, "strategy": "fsdp"},
    }


def _events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_elastic(system: str, work: str, cluster) -> dict:
    from elastic import Trainer

    job = elastic_job(system, "file://" + os.path.join(work, "runs"))
    events_path = os.path.join(work, "runs", job["run"]["name"], "events.jsonl")
    out: dict = {}

    def fit() -> None:
        try:
            out["result"] = Trainer(job).fit(progress=False)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the calling thread
            out["error"] = e

    fitter = threading.Thread(target=fit, daemon=True)
    t0 = time.time()
    fitter.start()
    while fitter.is_alive() and not any(e["kind"] == "checkpoint_committed" and e["step"] >= GROW_AFTER_STEP
                                        for e in _events(events_path)):
        fitter.join(0.2)
    node_t = None
    if fitter.is_alive():
        cluster.ensure_worker_nodes(MAX)  # from this (main) thread: Cluster.add_node sets signal handlers
        node_t = time.time()
    fitter.join()
    if "error" in out:
        raise out["error"]
    result = out["result"]
    done = result.events_of("resize_completed")
    grow = [d for d in done if d["new_world_size"] == MAX]
    rec = {"bench": "resize", "system": system, "resized": bool(grow), "old_world_size": MIN, "new_world_size": MAX,
           "final_step": result.metrics["step"], "total_s": time.time() - t0, "strategy": "fsdp"}
    if grow:
        g = grow[0]
        rec.update(resize_s=g["resize_s"], restore_s=g["restore_s"], path=g["path"], source=g["source"],
                   lost_steps=0, from_node_s=(g["first_step_t"] - node_t) if node_t else None)
    return rec


def run_ray_train(work: str, cluster) -> dict:
    from elastic.bench.ray_train_elastic import run_ray_train_resize
    r = run_ray_train_resize(work, num_steps=RAY_TRAIN_STEPS, grow_at_step=GROW_AFTER_STEP, ckpt_every=CKPT_EVERY,
                             cluster=cluster, min_workers=MIN, max_workers=MAX, global_batch_size=GLOBAL_BATCH,
                             resize_monitor_interval_s=RAY_TRAIN_MONITOR_S)
    # Ray Train's restart reloads its last checkpoint: the restore is the whole restart.
    return {**r, "restore_s": r.get("restart_s"), "from_node_s": r.get("resize_from_node_s")}


def main(args) -> int:
    from elastic.bench.local_cluster import local_cluster

    systems = parse_systems("resize", args.systems, list(SYSTEMS))
    if systems is None:
        return 2
    records: list[dict] = []
    work = tempfile.mkdtemp(prefix="elastic-bench-resize-")
    for rep in range(args.reps):
        for system in systems:  # interleaved, so drift on a shared machine hits every system alike
            # A fresh cluster each time: it must start with exactly MIN nodes, and Ray Train's resource
            # coordinator (a detached actor) would otherwise remember the previous run's nodes.
            with local_cluster(num_worker_nodes=MIN, cpus_per_node=1) as cluster:
                rec = run_ray_train(work, cluster) if system == "ray-train" else run_elastic(system, work, cluster)
            rec["rep"] = rep
            records.append(rec)
            emit(rec)
    med = medians([r for r in records if r.get("resized")], METRICS)
    notes = [f"{MIN} -> {MAX} workers when a one-CPU node joins a local ray.cluster_utils.Cluster; MLP 1.3M params, "
             f"AdamW, global batch {GLOBAL_BATCH}, checkpoint every {CKPT_EVERY} steps; elastic runs FSDP, Ray Train "
             f"DDP (its resize is a restart from a checkpoint either way); Ray Train's resize monitor interval "
             f"{RAY_TRAIN_MONITOR_S:g} s",
             "resize_s: decision -> first step at the new size; from_node_s: node registered -> same"]
    not_resized = [f"{r['system']} rep {r['rep']}" for r in records if not r.get("resized")]
    if not_resized:
        notes.append(f"finished before resizing (left out of the medians): {', '.join(not_resized)}")
    report_against_peer("resize", "resize (2 -> 3 ranks, node joins)", records, med, METRICS,
                        ["elastic-memory", "elastic-storage"], "ray-train", notes, args.out)
    return 0
