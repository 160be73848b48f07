"""`python -m benchmarks resize`: a node joins a running job, the group grows from 2 to 3 ranks.

Figure (docs/benchmarks/resize.md): resize_s, from the resize decision to the first
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
first step at the new size), not in resize_s. lost_steps is measured: the furthest step any rank
reached before the restore minus the step the new group resumed from (elastic's
`resize_completed` event; Ray Train's timeline).

`--params 900K,9M,90M` repeats the comparison at each model size (about 10 MB, 100 MB and 1 GB of
model + AdamW state) and `--storage s3` puts every system's checkpoints on a SeaweedFS S3 endpoint:
only larger states, read back over HTTP, show what re-sharding in memory is worth.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import uuid

from benchmarks.output import emit, medians, parse_systems, report_against_peer, scratch_dir

MIN, MAX, NUM_STEPS, CKPT_EVERY, GLOBAL_BATCH = 2, 3, 300, 10, 96
RAY_TRAIN_MONITOR_S = 5.0
# Steps a run needs after the node joins: Ray Train notices it within its 20 s resource view plus the
# monitor interval, then restarts. 300 steps of the 1.3 M and 9 M models (0.02 and 0.2 s each) cover
# that; at 2 s a step (90 M) 300 steps would be 10 minutes a run, so larger models run fewer.
LARGE_MODEL_PARAMS, LARGE_MODEL_STEPS = 50_000_000, 80


def num_steps(params: int) -> int:
    """Steps per run for a model of `params` parameters (the same for every system)."""
    return LARGE_MODEL_STEPS if params >= LARGE_MODEL_PARAMS else NUM_STEPS
GROW_AFTER_STEP = 20  # the node is added once a checkpoint at or after this step is committed
SYSTEMS = ["elastic-memory", "elastic-storage", "ray-train"]
METRICS = ["resize_s", "restore_s", "lost_steps", "from_node_s"]


def elastic_job(system: str, storage_uri: str, storage_options: dict | None = None, steps: int = NUM_STEPS) -> dict:
    return {
        "run": {"name": f"bench-resize-{uuid.uuid4().hex[:8]}", "num_steps": steps, "seed": 0},
        "scaling": {"num_workers": MIN, "min_workers": MIN, "max_workers": MAX, "grow_check_s": 1.0},
        "failure": {"max_failures": 2, "peer_restore": system == "elastic-memory"},
        "checkpoint": {"storage_uri": storage_uri, "storage_options": storage_options or {},
                       "every_steps": CKPT_EVERY},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "optimizer": "elastic.workload:build_optimizer",
                  "global_batch_size": GLOBAL_BATCH, "strategy": "fsdp"},
    }


def _events(run_dir: str, storage_options: dict | None = None) -> list[dict]:
    """The run's events so far, from local disk or an object store (numbered segments there)."""
    from elastic.storage import Storage, StorageError
    from elastic.observability.events import read_events
    try:
        return read_events(Storage(run_dir, storage_options or {}), run_dir)
    except (StorageError, ValueError):  # not there yet, or a segment being written
        return []


def grow_timeline(events: list[dict]) -> list[dict]:
    """A run's events (polls left out) with their time in seconds from the Grow decision, the
    form docs/benchmarks/resize.md's breakdowns quote; from the run's start if it never grew."""
    grow = [e for e in events if e["kind"] == "decision" and e.get("decision") == "Grow"]
    t0 = grow[0]["t"] if grow else events[0]["t"]
    return [{"t_from_grow_decision_s": round(e["t"] - t0, 3), **{k: v for k, v in e.items() if k != "t"}}
            for e in events if e["kind"] != "poll"]


def run_elastic(system: str, work: str, cluster, s3=None, steps: int = NUM_STEPS,
                timeline_path: str | None = None) -> dict:
    """One elastic run that grows when a node joins; with `timeline_path`, its events are written
    there as JSON lines (`grow_timeline`)."""
    from elastic import Trainer

    if s3 is not None:
        job = elastic_job(system, f"{s3.uri}/bench-resize", s3.storage_options, steps)
    else:
        job = elastic_job(system, "file://" + os.path.join(work, "runs"), steps=steps)
    # The run's event log lives under its storage URI (on S3 as numbered segments).
    run_dir = job["checkpoint"]["storage_uri"] + "/" + job["run"]["name"]
    out: dict = {}

    def fit() -> None:
        try:
            out["result"] = Trainer(job).fit(progress=False)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the calling thread
            out["error"] = e

    fitter = threading.Thread(target=fit, daemon=True)
    t0 = time.time()
    fitter.start()
    opts = job["checkpoint"]["storage_options"]
    while fitter.is_alive() and not any(e["kind"] == "checkpoint_committed" and e["step"] >= GROW_AFTER_STEP
                                        for e in _events(run_dir, opts)):
        fitter.join(0.2)
    node_t = None
    if fitter.is_alive():
        cluster.ensure_worker_nodes(MAX)  # from this (main) thread: Cluster.add_node sets signal handlers
        node_t = time.time()
    fitter.join()
    if "error" in out:
        raise out["error"]
    result = out["result"]
    if timeline_path:
        os.makedirs(os.path.dirname(timeline_path), exist_ok=True)
        with open(timeline_path, "w") as f:
            f.writelines(json.dumps(e, default=str) + "\n" for e in grow_timeline(result.events))
    done = result.events_of("resize_completed")
    grow = [d for d in done if d["new_world_size"] == MAX]
    rec = {"bench": "resize", "system": system, "resized": bool(grow), "old_world_size": MIN, "new_world_size": MAX,
           "final_step": result.metrics["step"], "total_s": time.time() - t0, "strategy": "fsdp"}
    if grow:
        g = grow[0]
        rec.update(resize_s=g["resize_s"], restore_s=g["restore_s"], path=g["path"], source=g["source"],
                   lost_steps=g["lost_steps"], reached_step=g["reached_step"], resumed_step=g["resumed_step"],
                   from_node_s=(g["first_step_t"] - node_t) if node_t else None)
    return rec


def run_ray_train(work: str, cluster, s3=None, steps: int = NUM_STEPS) -> dict:
    from benchmarks.ray_train_elastic import run_ray_train_resize
    r = run_ray_train_resize(work, num_steps=steps, grow_at_step=GROW_AFTER_STEP, ckpt_every=CKPT_EVERY,
                             cluster=cluster, min_workers=MIN, max_workers=MAX, global_batch_size=GLOBAL_BATCH,
                             resize_monitor_interval_s=RAY_TRAIN_MONITOR_S, s3=s3)
    # Ray Train's restart reloads its last checkpoint: the restore is the whole restart.
    return {**r, "restore_s": r.get("restart_s"), "from_node_s": r.get("resize_from_node_s")}


def main(args) -> int:
    from elastic.local_cluster import local_cluster
    from benchmarks.overhead import connect_with_env
    from benchmarks.recovery import STATE_BYTES_PER_PARAM, model_size, parse_params
    from elastic.workload import HIDDEN_ENV

    systems = parse_systems("resize", args.systems, list(SYSTEMS))
    if systems is None:
        return 2
    try:
        sizes = parse_params(args.params)
    except ValueError as e:
        print(f"python -m benchmarks resize: {e}", file=sys.stderr)
        return 2
    records: list[dict] = []
    work = scratch_dir("elastic-bench-resize-")
    with contextlib.ExitStack() as stack:
        s3 = None
        if args.storage == "s3":
            from tests.support.seaweedfs import seaweedfs_server
            s3 = stack.enter_context(seaweedfs_server())
        for size in sizes:
            hidden, params = model_size(size)
            for rep in range(args.reps):
                for system in systems:  # interleaved, so drift on a shared machine hits every system alike
                    # A fresh cluster each time: it must start with exactly MIN nodes, and Ray Train's resource
                    # coordinator (a detached actor) would otherwise remember the previous run's nodes.
                    with local_cluster(num_worker_nodes=MIN, cpus_per_node=1) as cluster:
                        if hidden:  # every process of every system builds this width (elastic.workload)
                            connect_with_env(cluster, {HIDDEN_ENV: str(hidden)})
                        timeline = (os.path.join(args.out, "resize-events", f"{system}-{params}-rep{rep}.jsonl")
                                    if args.out else None)
                        rec = (run_ray_train(work, cluster, s3, num_steps(params)) if system == "ray-train"
                               else run_elastic(system, work, cluster, s3, num_steps(params), timeline))
                    rec.update(rep=rep, params=params, state_MB=params * STATE_BYTES_PER_PARAM / 1e6,
                               storage=args.storage)
                    records.append(rec)
                    emit(rec)
    for size in sizes:
        _, params = model_size(size)
        mine = [r for r in records if r["params"] == params]
        med = medians([r for r in mine if r.get("resized")], METRICS)
        notes = [f"{MIN} -> {MAX} workers when a one-CPU node joins a local ray.cluster_utils.Cluster; MLP "
                 f"{params / 1e6:.1f} M params ({params * STATE_BYTES_PER_PARAM / 1e6:.0f} MB of model + AdamW state), "
                 f"global batch {GLOBAL_BATCH}, {num_steps(params)} steps, checkpoint every {CKPT_EVERY} steps to "
                 f"{'S3 (SeaweedFS)' if s3 else 'local disk'}; elastic runs FSDP, Ray Train DDP (its resize is a "
                 f"restart from a checkpoint either way); Ray Train's resize monitor interval {RAY_TRAIN_MONITOR_S:g} s",
                 "resize_s: decision -> first step at the new size; from_node_s: node registered -> same (includes "
                 "how long each system takes to notice the node); lost_steps: steps done again (measured)"]
        not_resized = [f"{r['system']} rep {r['rep']}" for r in mine if not r.get("resized")]
        if not_resized:
            notes.append(f"finished before resizing (left out of the medians): {', '.join(not_resized)}")
        from_node = {s: (med.get(s) or {}).get("from_node_s") for s in SYSTEMS}
        if from_node.get("ray-train"):
            notes += [f"from_node_s ratio {s} / ray-train (medians, same run): {v / from_node['ray-train']:.3f}"
                      for s, v in from_node.items() if v and s != "ray-train"]
        report_against_peer("resize", f"resize (2 -> 3 ranks, node joins, {params / 1e6:.1f} M params)", mine, med,
                            METRICS, ["elastic-memory", "elastic-storage"], "ray-train", notes, args.out)
    return 0
