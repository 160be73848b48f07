"""`python -m benchmarks pipeline`: elastic's pipeline strategy against its peers, in one run on one
local multi-node cluster, systems interleaved within each repetition.

Throughput (figure `pipeline_ratio`): steady-state steps/s of elastic's pipeline divided by
the same schedule under plain `torch.distributed.pipelining` (`benchmarks.plain_pipeline`,
plain processes under torchrun, no framework), at 2 stages x 1 replica and 2 stages x 2
replicas. Both train `examples.gpt` at the same size, on the same data (its dataset,
default_collate of the same indices), global batch, micro-batches, cut and optimizer. elastic
checkpoints once, after the last step; the plain pipeline never. Steps/s is timed the same way
for both: an optimizer post-step hook on global rank 0 logs every step's end
(`plain_pipeline.timed_optimizer`); the first WARMUP_STEPS steps are left out.

Stage loss (figures `recover_s`, fault -> first step completed after recovery, and
`lost_steps`): elastic against Ray Train running the same pipeline in its training function
(`TorchTrainer`, `FailureConfig`, checkpoints by `ray.train.report` every CKPT_EVERY steps, as
elastic's; benchmarks/ray_train_pipeline.py), which restarts the whole group from its last
registered checkpoint:

* 2 stages x 2 replicas, the process of rank 1 (stage 1 of replica 0) killed: elastic copies
  stage 1 from the surviving replica's memory;
* 3 stages x 1 replica, the node of rank 1 (the middle stage) killed: no replica holds it, so
  elastic returns every stage to its newest committed checkpoint.

The fault lands after FAULT_STEPS[rep % 3] steps: several offsets from the last checkpoint, all
after the second one, so that a checkpoint reported moments before the fault is not the only
one a system could resume from (Ray Train registers a report only at its controller's next poll).
The model's size reaches every Ray worker through the job's runtime env (`env_vars`), and the
plain processes through theirs.

`--tp T`: every stage split over T tensor-parallel ranks in every system (elastic's built-in
plan; the plain pipeline and Ray Train's apply the same `ColwiseParallel`/`RowwiseParallel`
styles per stage), in the throughput layouts whose stages x replicas x T ranks fit the cluster's
nodes, and one stage loss: 2 stages x 1 replica x T, a rank taking 1/T of a CPU so that a stage's
tp group shares a node, the node of rank 1 (stage 0's whole tp group) killed. No replica holds
stage 0: elastic restores both slices from their in-memory copies at buddies on another node;
Ray Train saves each rank's slices with `torch.distributed.checkpoint` and restarts from them.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

from benchmarks.output import emit, markdown_table, medians, parse_systems, scratch_dir, write_report
from benchmarks.plain_pipeline import STEP_LOG_ENV, step_rate

SEED, GLOBAL_BATCH, MICROBATCHES = 0, 48, 6  # 6 micro-batches suit 2 and 3 stages under every schedule
THROUGHPUT_LAYOUTS = [(2, 1), (2, 2)]  # (stages, replicas)
THROUGHPUT_STEPS, WARMUP_STEPS = 60, 10
RECOVERY_SCENARIOS = [  # (name, stages, replicas, fault)
    ("2x2 kill_process", 2, 2, "kill_process"),
    ("3x1 kill_node", 3, 1, "kill_node"),
]
TP_RECOVERY_SCENARIOS = [("2x1xtp kill_node", 2, 1, "kill_node")]  # --tp: stage 0's tp group lost whole
RECOVERY_STEPS, CKPT_EVERY, FAULT_STEPS, FAULT_RANK = 34, 10, (22, 25, 28), 1
NUM_NODES = 4  # one-CPU worker nodes: the largest layout (4 ranks), or 3 ranks and a node to replace one
SYSTEMS = ["elastic", "elastic-spare", "torch-pipelining", "ray-train"]  # elastic-spare: stage loss only
THROUGHPUT_METRICS = ["steps_per_s", "step_s", "median_step_s"]
RECOVERY_METRICS = ["recover_s", "lost_steps", "detect_s"]


# ---------------------------------------------------------------- settings (pure)
def gpt_env(size: str) -> dict[str, str]:
    """`--gpt LAYERS,DIM,CONTEXT` as the environment examples/gpt.py reads."""
    try:
        layers, dim, context = (int(v) for v in size.split(","))
    except ValueError:
        raise ValueError(f"--gpt: expected LAYERS,DIM,CONTEXT (three integers), got {size!r}") from None
    if min(layers, dim, context) < 1 or dim % 4:
        raise ValueError(f"--gpt: layers, dim and context must be >= 1 and dim a multiple of 4 (the heads), "
                         f"got {size!r}")
    return {"GPT_LAYERS": str(layers), "GPT_DIM": str(dim), "GPT_CONTEXT": str(context)}


def gpt_setup(size: str, extra: dict[str, str] | None = None) -> tuple[dict[str, str], int]:
    """`--gpt LAYERS,DIM,CONTEXT` for every process of a benchmark's systems: the environment they
    build examples/gpt.py with (its sizes, the repository on PYTHONPATH for `examples`, and
    `extra`), and the model's parameter count. Sets the environment here too: the model reads its
    sizes at import."""
    import examples
    repo = os.path.dirname(os.path.dirname(os.path.abspath(examples.__file__)))
    paths = [repo, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**gpt_env(size), **(extra or {}), "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    os.environ.update(env)
    from examples.gpt import build_model
    return env, sum(p.numel() for p in build_model().parameters())


def spares_for(system: str, stages: int, replicas: int, tp: int, fault: str) -> int | None:
    """Warm spares a stage-loss run of `system` keeps: one per rank a fault loses (a node kill
    with tp takes the whole tp group: tp ranks of 1/tp CPU, one node's worth), 0 for the others;
    None where the spares would not fit the cluster beside the ranks and a node to lose, or
    where the fault replaces a process in place (its slot is free at once: no spare needed)."""
    if system != "elastic-spare":
        return 0
    if fault != "kill_node":
        return None
    lost = tp if tp > 1 else 1
    nodes_used = stages * replicas + 1  # a node per stage's tp group (a rank per node without tp), one for the spares
    return lost if nodes_used <= NUM_NODES else None


def chunks_per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved_1f1b" else 1


def fault_step(rep: int) -> int:
    return FAULT_STEPS[rep % len(FAULT_STEPS)]


def split_points(stages: int, schedule: str) -> list[str]:
    """Where elastic's planner cuts examples.gpt (balanced by parameter count): the children that
    begin stages 2, 3, ... The plain and Ray Train peers cut there too."""
    from elastic.parallel.pipeline import plan_chunks, units_of
    from examples.gpt import build_model
    chunks = plan_chunks(units_of(build_model()), stages * chunks_per_rank(schedule))
    return [c[0] for c in chunks[1:]]


def elastic_job(stages: int, replicas: int, *, schedule: str, num_steps: int, every_steps: int, storage_uri: str,
                storage_options: dict, chaos: list[dict] = (), tp: int = 1, cpus_per_worker: float = 1,
                copy_sync: bool = False, num_spares: int = 0) -> dict:
    return {
        "run": {"name": f"bench-pipeline-{uuid.uuid4().hex[:8]}", "num_steps": num_steps, "seed": SEED},
        "scaling": {"num_workers": stages * replicas * tp, "cpus_per_worker": cpus_per_worker,
                    "num_spares": num_spares},
        "failure": {"max_failures": 2},
        "checkpoint": {"storage_uri": storage_uri, "storage_options": storage_options, "every_steps": every_steps,
                       **({"memory_sync": True, "memory_every_steps": 1} if copy_sync else {})},
        "train": {"model": "examples.gpt:build_model", "dataset": "examples.gpt:build_dataset",
                  "optimizer": "benchmarks.plain_pipeline:timed_optimizer", "global_batch_size": GLOBAL_BATCH,
                  "strategy": "pipeline", "tp": {"size": tp},
                  "pipeline": {"stages": stages, "schedule": schedule, "microbatches": MICROBATCHES,
                               "loss": "examples.gpt:stage_loss"}},
        "chaos": [dict(c) for c in chaos],
    }


def plain_command(stages: int, replicas: int, *, schedule: str, split: list[str], num_steps: int,
                  tp: int = 1) -> list[str]:
    """torchrun launching the plain pipeline, as torch's docs launch one."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages * replicas * tp}",
            "-m", "benchmarks.plain_pipeline", "--stages", str(stages), "--split", ",".join(split),
            "--schedule", schedule, "--stages-per-rank", str(chunks_per_rank(schedule)),
            "--microbatches", str(MICROBATCHES), "--global-batch", str(GLOBAL_BATCH), "--steps", str(num_steps),
            "--seed", str(SEED), "--tp", str(tp)]


def read_step_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def throughput_figures(lines: list[dict], num_steps: int) -> dict:
    """Steps/s from one run's step log (global rank 0, one line per optimizer step)."""
    if len(lines) != num_steps:
        raise RuntimeError(f"the step log has {len(lines)} lines for {num_steps} steps: the step clock missed steps "
                           f"or another run wrote to it")
    return {**step_rate([x["t"] for x in lines], WARMUP_STEPS), "threads": lines[-1]["threads"]}


# ---------------------------------------------------------------- throughput
def run_elastic_throughput(stages: int, replicas: int, schedule: str, step_log: str, storage_uri: str,
                           storage_options: dict, tp: int = 1) -> dict:
    from elastic import Trainer
    open(step_log, "w").close()
    job = elastic_job(stages, replicas, schedule=schedule, num_steps=THROUGHPUT_STEPS, every_steps=THROUGHPUT_STEPS,
                      storage_uri=storage_uri, storage_options=storage_options, tp=tp)
    result = Trainer(job).fit(progress=False)
    if result.events_of("recovered") or result.metrics["step"] != THROUGHPUT_STEPS:
        raise RuntimeError(f"elastic's throughput run was not fault-free: {result.summary()}")
    return throughput_figures(read_step_log(step_log), THROUGHPUT_STEPS)


def run_plain_throughput(stages: int, replicas: int, schedule: str, step_log: str, env: dict[str, str],
                         tp: int = 1) -> dict:
    open(step_log, "w").close()
    cmd = plain_command(stages, replicas, schedule=schedule, split=split_points(stages, schedule),
                        num_steps=THROUGHPUT_STEPS, tp=tp)
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"the plain pipeline failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return throughput_figures(read_step_log(step_log), THROUGHPUT_STEPS)


# ---------------------------------------------------------------- stage loss: elastic
def run_elastic_recovery(stages: int, replicas: int, fault: str, at_step: int, schedule: str, storage_uri: str,
                         storage_options: dict, tp: int = 1, copy_sync: bool = False, num_spares: int = 0) -> dict:
    from elastic import Trainer
    job = elastic_job(stages, replicas, schedule=schedule, num_steps=RECOVERY_STEPS, every_steps=CKPT_EVERY,
                      storage_uri=storage_uri, storage_options=storage_options,
                      chaos=[{"action": fault, "rank": FAULT_RANK, "at_step": at_step}], tp=tp,
                      cpus_per_worker=1 / tp, copy_sync=copy_sync, num_spares=num_spares)
    t0 = time.time()
    result = Trainer(job).fit(progress=False)
    rec = (result.events_of("recovered") or [{}])[0]
    plan = (result.events_of("restore_plan") or [{}])[0]
    restored = result.events_of("restored")[-1]
    return {"recover_s": rec.get("recover_s"), "lost_steps": rec.get("lost_steps"), "detect_s": rec.get("detect_s"),
            "fault_step": rec.get("fault_step"), "resumed_step": rec.get("resumed_step"),
            "restore_plan": plan.get("source"), "restore_reason": plan.get("reason"), "restore_source": restored["source"],
            "final_step": result.metrics["step"], "total_s": time.time() - t0, "run_dir": result.run_dir}


# ---------------------------------------------------------------- the run
def connect_with_env(cluster, env: dict[str, str]) -> None:
    """Reconnect the driver with a job-level runtime env: every actor of the job (elastic's
    workers, Ray Train's controller and workers) starts with these variables."""
    import logging

    import ray
    ray.shutdown()
    ray.init(address=cluster.address, runtime_env={"env_vars": env}, logging_level=logging.WARNING)


def summarise(records: list[dict]) -> tuple[dict, str]:
    """Medians per (system, layout) and per (system, scenario), the ratios against the peers, and
    the markdown tables."""
    thr = [r for r in records if r["part"] == "throughput"]
    rec = [r for r in records if r["part"] == "recovery"]
    out: dict = {"throughput": {}, "recovery": {}}
    md = []
    if thr:
        med = medians([{**r, "row": f"{r['system']} {r['layout']}"} for r in thr],
                      THROUGHPUT_METRICS + ["pipeline_ratio"], key="row")
        notes = []
        for layout in dict.fromkeys(r["layout"] for r in thr):
            mine, peer = med.get(f"elastic {layout}", {}), med.get(f"torch-pipelining {layout}", {})
            entry = {"elastic_steps_per_s": mine.get("steps_per_s"), "plain_steps_per_s": peer.get("steps_per_s"),
                     "median_of_rep_ratios": mine.get("pipeline_ratio")}
            if entry["elastic_steps_per_s"] and entry["plain_steps_per_s"]:
                entry["pipeline_ratio"] = entry["elastic_steps_per_s"] / entry["plain_steps_per_s"]
                notes.append(f"pipeline_ratio {layout} (elastic / torch-pipelining, medians of the same run): "
                             f"{entry['pipeline_ratio']:.3f}; median of the per-repetition ratios "
                             f"{entry['median_of_rep_ratios']:.3f}")
            out["throughput"][layout] = entry
        md.append(markdown_table(med, THROUGHPUT_METRICS + ["pipeline_ratio"], "pipeline throughput (steady state)",
                                 notes))
    if rec:
        med = medians([{**r, "row": f"{r['system']} {r['scenario']}"} for r in rec], RECOVERY_METRICS, key="row")
        notes = []
        for scenario in dict.fromkeys(r["scenario"] for r in rec):
            peer = med.get(f"ray-train {scenario}", {})
            entry = {f"ray_train_{m}": peer.get(m) for m in RECOVERY_METRICS}
            for system in ("elastic", "elastic-spare"):
                mine, key = med.get(f"{system} {scenario}", {}), system.replace("-", "_")
                if not mine:
                    continue
                entry.update({f"{key}_{m}": mine.get(m) for m in RECOVERY_METRICS})
                if mine.get("recover_s") and peer.get("recover_s"):
                    ratio = mine["recover_s"] / peer["recover_s"]
                    entry["recover_s_ratio" if system == "elastic" else f"{key}_recover_s_ratio"] = ratio
                    notes.append(f"recover_s ratio {scenario} ({system} / ray-train, medians of the same run): "
                                 f"{ratio:.3f}")
            out["recovery"][scenario] = entry
        md.append(markdown_table(med, RECOVERY_METRICS, "pipeline stage loss", notes))
    return out, "\n".join(md)


def plot(path: str, records: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [("throughput", "layout", "steps_per_s"), ("recovery", "scenario", "recover_s")]
    parts = [p for p in parts if any(r["part"] == p[0] for r in records)]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 3.8), squeeze=False)
    for ax, (part, group, metric) in zip(axes[0], parts):
        rows = list(dict.fromkeys((r[group], r["system"]) for r in records if r["part"] == part))
        for i, (g, s) in enumerate(rows):
            vals = [r[metric] for r in records if r["part"] == part and r[group] == g and r["system"] == s
                    and r.get(metric) is not None]
            if vals:
                ax.bar(i, statistics.median(vals), color="#8fb3d9" if s.startswith("elastic") else "#d9b38f", width=0.6)
                ax.scatter([i] * len(vals), vals, color="#1f4e79", zorder=3, s=14)
        ax.set_xticks(range(len(rows)), [f"{s}\n{g}" for g, s in rows], fontsize=7)
        ax.set_ylabel(metric)
        ax.set_title(f"pipeline {part}: {metric} (bar: median)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    from elastic.local_cluster import local_cluster

    systems = parse_systems("pipeline", args.systems, list(SYSTEMS))
    if systems is None:
        return 2
    try:
        env = gpt_env(args.gpt)
    except ValueError as e:
        print(f"python -m benchmarks pipeline: {e}", file=sys.stderr)
        return 2
    loaded = sys.modules.get("examples.gpt")
    if loaded is not None and (loaded.N_LAYER, loaded.DIM, loaded.CONTEXT) != tuple(int(v) for v in env.values()):
        print("python -m benchmarks pipeline: examples.gpt is already imported at another size in this process",
              file=sys.stderr)
        return 2
    schedule, tp = args.schedule, getattr(args, "tp", None) or 1
    copy_sync = bool(getattr(args, "copy_sync", False))
    if tp > 1 and schedule == "interleaved_1f1b":
        print("python -m benchmarks pipeline: --tp with --schedule interleaved_1f1b is not measured (a tp rank "
              "holds one stage)", file=sys.stderr)
        return 2
    work = scratch_dir("elastic-bench-pipeline-")
    step_log = os.path.join(work, "steps.jsonl")
    import examples
    repo = os.path.dirname(os.path.dirname(os.path.abspath(examples.__file__)))
    paths = [repo, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    pythonpath = os.pathsep.join(dict.fromkeys(paths))
    env = {**env, STEP_LOG_ENV: step_log, "PYTHONPATH": pythonpath}
    # The driver builds the model and dataset too (elastic checks the cut there; the split is planned here).
    os.environ.update(env)
    from examples.gpt import build_model
    params = sum(p.numel() for p in build_model().parameters())
    common = {"bench": "pipeline", "schedule": schedule, "params": params, "gpt": args.gpt,
              "global_batch": GLOBAL_BATCH, "microbatches": MICROBATCHES}
    records: list[dict] = []
    with contextlib.ExitStack() as stack:
        storage_uri, storage_options = "file://" + os.path.join(work, "runs"), {}
        if args.storage == "s3":
            from tests.support.seaweedfs import seaweedfs_server
            s3 = stack.enter_context(seaweedfs_server())
            storage_uri, storage_options = f"{s3.uri}/bench", s3.storage_options
        cluster = stack.enter_context(local_cluster(num_worker_nodes=NUM_NODES, cpus_per_node=1))
        connect_with_env(cluster, env)
        for rep in range(args.reps):
            # Throughput: the two systems back to back per layout, their order alternating by repetition.
            order = [s for s in ("elastic", "torch-pipelining") if s in systems]
            if rep % 2:
                order.reverse()
            for stages, replicas in THROUGHPUT_LAYOUTS:
                if stages * replicas * tp > NUM_NODES:
                    continue  # a rank per one-CPU node
                layout = f"{stages}x{replicas}" + (f"xtp{tp}" if tp > 1 else "")
                got = {}
                for system in order:
                    cluster.ensure_worker_nodes(NUM_NODES)
                    t0 = time.time()
                    if system == "elastic":
                        figs = run_elastic_throughput(stages, replicas, schedule, step_log, storage_uri,
                                                      storage_options, tp)
                    else:
                        figs = run_plain_throughput(stages, replicas, schedule, step_log, env, tp)
                    got[system] = {**common, "part": "throughput", "system": system, "layout": layout,
                                   "stages": stages, "replicas": replicas, "tp": tp, "rep": rep, "num_steps": THROUGHPUT_STEPS,
                                   "warmup_steps": WARMUP_STEPS, **figs, "total_s": time.time() - t0}
                if "elastic" in got and "torch-pipelining" in got:
                    got["elastic"]["pipeline_ratio"] = (got["elastic"]["steps_per_s"]
                                                        / got["torch-pipelining"]["steps_per_s"])
                for r in got.values():
                    records.append(r)
                    emit(r)
            # Stage loss; with tp, stage 0's whole tp group.
            at = fault_step(rep)
            for scenario, stages, replicas, fault in (TP_RECOVERY_SCENARIOS if tp > 1 else RECOVERY_SCENARIOS):
                scenario = scenario.replace("xtp", f"xtp{tp}")
                for system in [s for s in ("elastic", "elastic-spare", "ray-train") if s in systems]:
                    spares = spares_for(system, stages, replicas, tp, fault)
                    if spares is None:
                        continue  # no node left for the spares, or one replaced in place
                    cluster.ensure_worker_nodes(NUM_NODES)
                    if system.startswith("elastic"):
                        figs = run_elastic_recovery(stages, replicas, fault, at, schedule, storage_uri,
                                                    storage_options, tp, copy_sync, spares)
                    else:
                        from benchmarks.ray_train_pipeline import run_ray_train_recovery
                        figs = run_ray_train_recovery(stages, replicas, fault, at, schedule, work, tp)
                    r = {**common, "part": "recovery", "system": system, "scenario": scenario, "stages": stages,
                         "replicas": replicas, "tp": tp, "fault": fault, "fault_rank": FAULT_RANK, "rep": rep,
                         "ckpt_every": CKPT_EVERY, "num_steps": RECOVERY_STEPS,
                         "storage": args.storage if system.startswith("elastic") else "file",
                         **({"copy_sync": copy_sync, "num_spares": spares} if system.startswith("elastic") else {}),
                         **figs}
                    records.append(r)
                    emit(r)
    summary, table = summarise(records)
    faults = ", ".join(str(fault_step(r)) for r in range(min(args.reps, len(FAULT_STEPS))))
    notes = (f"examples/gpt.py at GPT_LAYERS,GPT_DIM,GPT_CONTEXT={args.gpt} ({params:,} parameters), schedule "
             f"{schedule}, global batch {GLOBAL_BATCH} in {MICROBATCHES} micro-batches per replica; local "
             f"ray.cluster_utils.Cluster of {NUM_NODES} one-CPU nodes; steps/s timed from the end of step "
             f"{WARMUP_STEPS + 1} to the end of step {THROUGHPUT_STEPS} by an optimizer post-step hook on global "
             f"rank 0; stage loss: checkpoint every {CKPT_EVERY} steps, fault after step {faults} (by repetition) "
             f"of {RECOVERY_STEPS}")
    emit({"bench": "pipeline", "summary": True, **summary})
    write_report(args.out, records, table, notes, "pipeline.json",
                 {"command": " ".join(["elastic", *sys.argv[1:]]) if sys.argv else None, "notes": notes, **summary})
    if args.out:
        plot(os.path.join(args.out, "pipeline.png"), records)
        print(f"wrote {args.out}/results.jsonl, results.md, pipeline.json, pipeline.png")
    return 0
