"""`python -m benchmarks parallel`: elastic's tensor-parallel layouts against the same model, plan
and data under a plain torch script (`benchmarks.plain_tp`, torchrun, torchtitan-style), in one run
on one local cluster, systems interleaved within each repetition.

Throughput (figure `parallel_ratio`): steady-state steps/s of elastic divided by the plain
script's, per layout (`--layouts`, default ddp:dp2xtp2,fsdp:dp2xtp2,ddp:dp4,fsdp:dp4). Both train
`examples/gpt.py` at `--gpt` LAYERS,DIM,CONTEXT, with the global batch BATCH, AdamW, one compute
thread per rank; elastic checkpoints once, after the last step, the plain script never. Steps/s
is timed the same way for both: an optimizer post-step hook on global rank 0 logs every step's
end (`plain_pipeline.timed_optimizer`); the first WARMUP_STEPS steps are left out.

The cluster: NODES worker nodes of 2 CPUs; elastic's ranks take one CPU each, so a tp group of 2
starts on one node. The plain processes run beside it on the same machine, at the niceness Ray
gives its workers (as `benchmarks overhead` runs its torch DDP peer).

A layout ending in `+sp` (e.g. fsdp:dp2xtp2+sp) turns on sequence parallelism, in elastic and in
the plain script alike.

Memory (`--memory`): peak resident memory per rank of elastic per layout (default MEMORY_LAYOUTS,
real gloo ranks in spawned processes, no Ray), per model size (`--gpt` sizes separated by `;`),
eager build against `train.meta_init`, and activation checkpointing off and on: the peak after
the build and the peak over MEMORY_STEPS steps (one asynchronous checkpoint's staging included).

With `--world-sizes 2,4,8` instead: whether each rank's memory falls as 1/N, FSDP with meta init
with the in-memory copies and checkpoint staging off and on (`benchmarks.memory_per_rank`).

Pipeline x tp is measured by `python -m benchmarks pipeline --tp 2`, a lost tp group by
`python -m benchmarks recovery --tp 2`, CPU offload's GPU memory by
`python -m benchmarks.probes.gpu_step_profile --memory`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from benchmarks.output import emit, medians, parse_systems, scratch_dir, write_report
from benchmarks.overhead import ray_worker_niceness
from benchmarks.pipeline import connect_with_env, gpt_env, gpt_setup, read_step_log
from benchmarks.plain_pipeline import STEP_LOG_ENV, step_rate

SEED, BATCH, STEPS, WARMUP_STEPS = 0, 16, 60, 10
MEMORY_STEPS = 2
NODES = 2
SYSTEMS = ["elastic", "torch"]
DEFAULT_LAYOUTS = "ddp:dp2xtp2,fsdp:dp2xtp2,ddp:dp4,fsdp:dp4"
MEMORY_LAYOUTS = "fsdp:dp4"


def parse_layout(spec: str) -> tuple[str, int, int, bool]:
    """'fsdp:dp2xtp2' -> ("fsdp", 2, 2, False); 'ddp:dp4' -> ("ddp", 4, 1, False); a '+sp' suffix
    (with tp > 1): sequence parallelism on. ValueError naming the flag."""
    try:
        strategy, shape = spec.split(":")
        sp = shape.endswith("+sp")
        parts = dict((p[:2], int(p[2:])) for p in shape.removesuffix("+sp").split("x"))
        dp, tp = parts.pop("dp"), parts.pop("tp", 1)
        if parts or strategy not in ("ddp", "fsdp") or min(dp, tp) < 1 or (sp and tp < 2):
            raise ValueError
    except (ValueError, KeyError):
        raise ValueError(f"--layouts: expected STRATEGY:dpDxtpT[+sp] (ddp or fsdp, e.g. fsdp:dp2xtp2, ddp:dp4, or "
                         f"fsdp:dp2xtp2+sp for sequence parallelism, which needs tp >= 2), got {spec!r}") from None
    return strategy, dp, tp, sp


def layout_name(strategy: str, dp: int, tp: int, sp: bool) -> str:
    return f"{strategy} dp{dp}xtp{tp}{' +sp' if sp else ''}"


def elastic_job(strategy: str, dp: int, tp: int, storage_uri: str, sp: bool = False) -> dict:
    return {
        "run": {"name": f"bench-parallel-{uuid.uuid4().hex[:8]}", "num_steps": STEPS, "seed": SEED},
        "scaling": {"num_workers": dp * tp, "cpus_per_worker": 1},
        "checkpoint": {"storage_uri": storage_uri, "every_steps": STEPS},
        "train": {"model": "examples.gpt:build_model", "dataset": "examples.gpt:build_dataset",
                  "loss": "examples.gpt:loss_fn", "optimizer": "benchmarks.plain_pipeline:timed_optimizer",
                  "global_batch_size": BATCH, "strategy": strategy,
                  "tp": {"size": tp, **({"sequence_parallel": True} if sp else {})}},
    }


def figures(step_log: str) -> dict:
    lines = read_step_log(step_log)
    if len(lines) != STEPS:
        raise RuntimeError(f"the step log has {len(lines)} lines for {STEPS} steps")
    return {**step_rate([x["t"] for x in lines], WARMUP_STEPS), "threads": lines[-1]["threads"]}


def run_elastic(strategy: str, dp: int, tp: int, sp: bool, step_log: str, storage_uri: str) -> dict:
    from elastic import Trainer
    open(step_log, "w").close()
    result = Trainer(elastic_job(strategy, dp, tp, storage_uri, sp)).fit(progress=False)
    if result.events_of("recovered") or result.metrics["step"] != STEPS:
        raise RuntimeError(f"elastic's run was not fault-free: {result.summary()}")
    placed = result.events_of("placement")
    return {**figures(step_log), "tp_split_groups": placed[0]["split_groups"] if placed else []}


def run_plain(strategy: str, dp: int, tp: int, sp: bool, step_log: str, env: dict[str, str], niceness: int) -> dict:
    """The plain script under torchrun, at the priority Ray gives its workers (as the overhead
    benchmark runs its torch DDP peer): background processes then preempt both alike."""
    open(step_log, "w").close()
    increment = max(0, niceness - os.getpriority(os.PRIO_PROCESS, 0))
    cmd = ["nice", "-n", str(increment), sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp * tp}",
           "-m", "benchmarks.plain_tp", "--strategy", strategy, "--tp", str(tp), "--steps", str(STEPS),
           "--global-batch", str(BATCH), "--seed", str(SEED), *(["--sequence-parallel"] if sp else [])]
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"the plain script failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return figures(step_log)


def summarise(records: list[dict]) -> tuple[dict, str]:
    med = medians([{**r, "row": f"{r['layout']} {r['system']}"} for r in records],
                  ["steps_per_s", "median_step_s", "parallel_ratio"], key="row")
    lines = ["| layout | system | reps | median steps/s | median step s | elastic ÷ torch (median of reps) |",
             "|---|---|---|---|---|---|"]
    for row, m in med.items():
        layout, system = row.rsplit(" ", 1)
        ratio = f"{m['parallel_ratio']:.3f}" if m.get("parallel_ratio") is not None else ""
        lines.append(f"| {layout} | {system} | {m['n']} | {m['steps_per_s']:.2f} | {m['median_step_s']:.4f} | {ratio} |")
    return med, "\n".join(lines) + "\n"


def run_memory(sizes: list[str], layouts: list[tuple], out: str | None) -> int:
    """Peak RSS per rank (MiB) for each size x layout x {eager, meta init} x {activation
    checkpointing off, on}."""
    from tests.spawn_ranks import run_ranks
    records = []
    for size in sizes:
        env = gpt_env(size)
        for strategy, dp, tp, sp in layouts:
            for meta in (False, True):
                for ac in (None, ["Block"]):
                    work = scratch_dir("elastic-bench-parallel-mem-")
                    job = {"run": {"name": "mem", "num_steps": MEMORY_STEPS, "seed": SEED},
                           "scaling": {"num_workers": dp * tp},
                           "checkpoint": {"storage_uri": f"file://{work}", "every_steps": 100},
                           "train": {"model": "examples.gpt:build_model", "dataset": "examples.gpt:build_dataset",
                                     "loss": "examples.gpt:loss_fn", "global_batch_size": BATCH, "strategy": strategy,
                                     "tp": {"size": tp, **({"sequence_parallel": True} if sp else {})},
                                     "meta_init": meta, "activation_checkpointing": ac}}
                    out_ranks = run_ranks(job, steps=MEMORY_STEPS, env=env)
                    r = {"bench": "parallel", "part": "memory", "gpt": size, "layout": layout_name(strategy, dp, tp, sp),
                         "strategy": strategy, "world": dp * tp, "tp": tp, "sequence_parallel": sp,
                         "meta_init": meta, "activation_checkpointing": bool(ac),
                         "build_peak_mib": max(o[6]["restored_rss_mb"] for o in out_ranks),
                         "run_peak_mib": max(o[6]["maxrss_mb"] for o in out_ranks)}
                    records.append(r)
                    emit(r)
    lines = ["| GPT layers,dim,context | layout | build | activation checkpointing | peak RSS after the build (MiB) | "
             "peak RSS over the run (MiB) |", "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['gpt']} | {r['layout']} | {'meta init' if r['meta_init'] else 'eager'} | "
                     f"{'on' if r['activation_checkpointing'] else 'off'} | {r['build_peak_mib']:.0f} | "
                     f"{r['run_peak_mib']:.0f} |")
    table = "\n".join(lines) + "\n"
    notes = (f"real gloo ranks (spawned processes, no Ray), global batch {BATCH}, AdamW, {MEMORY_STEPS} steps; the "
             f"largest rank's ru_maxrss")
    write_report(out, records, table, notes)
    return 0


def main(args) -> int:
    from elastic.local_cluster import local_cluster

    if getattr(args, "memory", False) and getattr(args, "world_sizes", None) is not None:
        from benchmarks import memory_per_rank
        try:
            world_sizes = memory_per_rank.parse_world_sizes(args.world_sizes)
            sizes = (args.gpt_sizes or args.gpt).split(";")
            for size in sizes:
                gpt_env(size)
        except ValueError as e:
            print(f"python -m benchmarks parallel: {e}", file=sys.stderr)
            return 2
        return memory_per_rank.run(sizes, world_sizes, args.reps, args.out)
    if getattr(args, "memory", False):
        try:
            layouts = [parse_layout(x) for x in (args.layouts or MEMORY_LAYOUTS).split(",")]
            return run_memory((args.gpt_sizes or args.gpt).split(";"), layouts, args.out)
        except ValueError as e:
            print(f"python -m benchmarks parallel: {e}", file=sys.stderr)
            return 2

    systems = parse_systems("parallel", args.systems, list(SYSTEMS))
    if systems is None:
        return 2
    try:
        layouts = [parse_layout(s) for s in (args.layouts or DEFAULT_LAYOUTS).split(",")]
        gpt_env(args.gpt)
    except ValueError as e:
        print(f"python -m benchmarks parallel: {e}", file=sys.stderr)
        return 2
    work = scratch_dir("elastic-bench-parallel-")
    step_log = os.path.join(work, "steps.jsonl")
    env, params = gpt_setup(args.gpt, {STEP_LOG_ENV: step_log})
    common = {"bench": "parallel", "params": params, "gpt": args.gpt, "global_batch": BATCH, "num_steps": STEPS,
              "warmup_steps": WARMUP_STEPS}
    records: list[dict] = []
    storage_uri = "file://" + os.path.join(work, "runs")
    with local_cluster(num_worker_nodes=NODES, cpus_per_node=2) as cluster:
        connect_with_env(cluster, env)
        niceness = ray_worker_niceness()
        common["niceness"] = niceness
        for rep in range(args.reps):
            order = [s for s in SYSTEMS if s in systems]
            if rep % 2:
                order.reverse()
            for strategy, dp, tp, sp in layouts:
                layout = layout_name(strategy, dp, tp, sp)
                got = {}
                for system in order:
                    cluster.ensure_worker_nodes(NODES)
                    t0 = time.time()
                    figs = (run_elastic(strategy, dp, tp, sp, step_log, storage_uri) if system == "elastic"
                            else run_plain(strategy, dp, tp, sp, step_log, env, niceness))
                    got[system] = {**common, "system": system, "layout": layout, "strategy": strategy, "dp": dp,
                                   "tp": tp, "sequence_parallel": sp, "rep": rep, **figs, "total_s": time.time() - t0}
                if len(got) == 2:
                    got["elastic"]["parallel_ratio"] = got["elastic"]["steps_per_s"] / got["torch"]["steps_per_s"]
                for r in got.values():
                    records.append(r)
                    emit(r)
    summary, table = summarise(records)
    notes = (f"examples/gpt.py at GPT_LAYERS,GPT_DIM,GPT_CONTEXT={args.gpt} ({params:,} parameters), global batch "
             f"{BATCH}, AdamW, one compute thread per rank, gloo; elastic on a local cluster of {NODES} nodes of 2 "
             f"CPUs (a rank per CPU), the plain script under torchrun beside it at Ray's worker niceness; steps/s from the end of step "
             f"{WARMUP_STEPS + 1} to the end of step {STEPS}, timed by an optimizer post-step hook on global rank 0; "
             f"systems alternate order by repetition")
    write_report(args.out, records, table, notes, "parallel.json",
                 {"command": " ".join(["python -m benchmarks", *sys.argv[1:]]), "notes": notes, "medians": summary})
    if args.out:
        print(f"wrote {args.out}/results.jsonl, results.md, parallel.json")
    return 0
