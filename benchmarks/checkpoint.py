"""`python -m benchmarks checkpoint`: what a checkpoint costs the training, and how fast it reaches S3
compared with s3fs writing the same bytes itself.

One elastic DDP run per model size (2 ranks on the 2 one-CPU worker nodes of a local
ray.cluster_utils.Cluster, a checkpoint every `plan()` steps to a SeaweedFS S3 endpoint
on loopback, through s3fs), the MLP of `python -m benchmarks overhead` (hidden 3072: 10.3 M
parameters; 10000: 102.7 M), AdamW. Per committed checkpoint:

* stall_s: how long rank 0's training thread was held by the save (`stall_s` of the
  `checkpoint_committed` event: waiting for the previous persist, then the in-memory snapshot);
* step_s: the median step after the warm-up and before the first checkpoint;
* extra_s: the interval of the step after the save minus step_s (the stall, as the step clock
  sees it); period_extra_s: the same summed over the checkpoint's whole period (everything the
  checkpoint cost training: the stall, and the persist competing for the CPU while it runs);
* persist_s and bytes: snapshot handed over -> committed (agreement, DCP plan, shards, manifest
  and marker), and the bytes in the committed folder; persist_MBps = bytes / persist_s.

raw: the driver reads the committed folder's files into memory, then writes the same files,
same names and sizes, to a fresh prefix of the same bucket with one s3fs `pipe` call (every
file at once, concurrently), RAW_REPS times: raw_MBps = bytes / median time. The target is
persist_MBps >= 0.8 x raw_MBps (issue 9).

raw beside training: the same writes while the same training runs again (a second run of the
same job, with no checkpoint until its end), each after a pause of RAW_GAP_S: raw s3fs on a
machine as busy as it was during the persists, so that persist ÷ raw beside training is what
elastic's persist costs over s3fs's own write, with this machine's contention the same for both
(the S3 server, training and the write share its cores). The writes come from the driver, a
process of their own; a rank's persist shares its process with training.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid

from benchmarks.output import append_markdown, append_results, emit
from benchmarks.overhead import (HIDDEN_ENV, STEP_LOG_ENV, connect_with_env, num_params, parse_hidden,
                                    read_step_log)

NUM_WORKERS, GLOBAL_BATCH, SEED = 2, 96, 0
# --spare-core: one rank on a node of two CPUs. Training keeps one compute thread
# (cpus_per_worker 1), so the persist has a core of its own instead of sharing the rank's.
SPARE_CORE_LAYOUT = {"num_workers": 1, "cpus_per_node": 2}
DEFAULT_LAYOUT = {"num_workers": NUM_WORKERS, "cpus_per_node": 1}
DEFAULT_HIDDEN = "3072,10000"
LARGE_PARAMS = 50_000_000  # from here on a step takes seconds here: fewer, longer-spaced checkpoints
RAW_REPS = 5
RAW_GAP_S = 2.0  # beside training, a pause before each raw write (persists, too, are spaced by training)
STALL_TARGET = 1.0  # stall <= this many step times
PERSIST_TARGET = 0.8  # persist throughput >= this fraction of raw s3fs


def plan(hidden: int) -> dict:
    """Checkpoint interval and count for one size. The interval leaves each persist time to
    finish before the next checkpoint step (a persist still running there defers that checkpoint,
    and the figure would be of a deferral, not of a save): about 5 s at 10 M parameters (123 MB
    at ~90 MB/s here), 40 s at 100 M (1.2 GB)."""
    if num_params(hidden) >= LARGE_PARAMS:
        return {"every": 20, "num_checkpoints": 3}
    return {"every": 25, "num_checkpoints": 4}


def elastic_job(hidden: int, storage_uri: str, storage_options: dict, every: int, num_steps: int,
                num_workers: int = NUM_WORKERS) -> dict:
    return {
        "run": {"name": f"bench-checkpoint-{uuid.uuid4().hex[:8]}", "num_steps": num_steps, "seed": SEED},
        "scaling": {"num_workers": num_workers, "cpus_per_worker": 1},
        "checkpoint": {"storage_uri": storage_uri, "storage_options": storage_options, "every_steps": every},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "optimizer": "benchmarks.overhead:timed_optimizer",
                  "global_batch_size": GLOBAL_BATCH},
    }


# ---------------------------------------------------------------- figures (pure)
def step_intervals(times: list[float]) -> dict[int, float]:
    """Step s -> its duration (end of step s - end of step s - 1), for s >= 2 (t[s-1] ends step s)."""
    ts = sorted(times)
    return {s: ts[s - 1] - ts[s - 2] for s in range(2, len(ts) + 1)}


def checkpoint_figures(intervals: dict[int, float], saved_steps: list[int], warmup_steps: int,
                       every: int) -> dict:
    """step_s: the median step after the warm-up and before the first checkpoint (nothing saved or
    in flight yet). Per saved step s: extra_s, step s + 1's time above step_s (the save of step s
    happens after step s ends, so its stall lands in step s + 1); period_extra_s, the same summed
    over steps s + 1 .. s + every: everything the checkpoint cost training, its stall and the
    persist competing with training for the CPU while it runs."""
    first = min(saved_steps, default=max(intervals, default=0))
    clean = [d for s, d in intervals.items() if warmup_steps < s <= first]
    if not clean:
        raise ValueError(f"no step after the {warmup_steps}-step warm-up and before the first checkpoint "
                         f"(step {first})")
    step_s = statistics.median(clean)
    period = {s: sum(intervals[k] - step_s for k in range(s + 1, s + every + 1))
              for s in saved_steps if all(k in intervals for k in range(s + 1, s + every + 1))}
    return {"step_s": step_s,
            "extra_s": {s: intervals[s + 1] - step_s for s in saved_steps if s + 1 in intervals},
            "period_extra_s": period}


def summarise(records: list[dict], raw: dict[int, dict]) -> tuple[list[dict], str]:
    """Per size: medians over its checkpoints, and the persist throughput ÷ raw s3fs."""
    rows = []
    lines = ["| parameters | checkpoint size | checkpoints | median step_s | median stall_s | max stall_s | "
             "stall ÷ step | median extra_s | median period_extra_s | median persist_s | persist MB/s | raw s3fs MB/s | "
             "persist ÷ raw | raw s3fs beside training MB/s | persist ÷ raw beside training |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for params in sorted({r["params"] for r in records}):
        mine = [r for r in records if r["params"] == params]
        step_s = statistics.median(r["step_s"] for r in mine)
        stall = [r["stall_s"] for r in mine if r.get("stall_s") is not None]
        extra = [r["extra_s"] for r in mine if r.get("extra_s") is not None]
        period = [r["period_extra_s"] for r in mine if r.get("period_extra_s") is not None]
        persist_mbps = statistics.median(r["persist_MBps"] for r in mine)
        raw_mbps = raw[params]["raw_MBps"]
        row = {"params": params, "bytes": statistics.median(r["bytes"] for r in mine), "checkpoints": len(mine),
               "step_s": step_s, "median_stall_s": statistics.median(stall) if stall else None,
               "max_stall_s": max(stall) if stall else None,
               "median_extra_s": statistics.median(extra) if extra else None,
               "median_period_extra_s": statistics.median(period) if period else None,
               "median_persist_s": statistics.median(r["persist_s"] for r in mine),
               "persist_MBps": persist_mbps, "raw_MBps": raw_mbps, "persist_over_raw": persist_mbps / raw_mbps}
        beside = raw[params].get("raw_beside_MBps")
        row["raw_beside_MBps"] = beside
        row["persist_over_raw_beside"] = persist_mbps / beside if beside else None
        row["stall_over_step"] = row["median_stall_s"] / step_s if stall else None
        rows.append(row)

        def f(v, fmt="{:.3f}"):
            return "-" if v is None else fmt.format(v)
        lines.append(f"| {params / 1e6:.1f} M | {row['bytes'] / 1e6:.0f} MB | {len(mine)} | {f(step_s)} | "
                     f"{f(row['median_stall_s'])} | {f(row['max_stall_s'])} | {f(row['stall_over_step'], '{:.2f}')} | "
                     f"{f(row['median_extra_s'])} | {f(row['median_period_extra_s'])} | "
                     f"{f(row['median_persist_s'], '{:.2f}')} | "
                     f"{f(persist_mbps, '{:.0f}')} | {f(raw_mbps, '{:.0f}')} | {row['persist_over_raw']:.2f} | "
                     f"{f(beside, '{:.0f}')} | {f(row['persist_over_raw_beside'], '{:.2f}')} |")
    return rows, "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the runs
def folder_files(fs, folder: str) -> dict[str, int]:
    """name -> size of every file in a committed checkpoint folder (DCP shards, metadata, manifest)."""
    return {p.rsplit("/", 1)[1]: int(info["size"]) for p, info in fs.find(folder, detail=True).items()}


def raw_write(fs, bucket_path: str, blobs: dict[str, bytes], reps: int, gap_s: float = 0.0,
              spans: list | None = None) -> list[float]:
    """Write the same files with one concurrent s3fs `pipe` call per repetition, each after
    `gap_s` of pause; seconds each. `spans` collects each write's (start, end) wall-clock times."""
    times = []
    for _ in range(reps):
        time.sleep(gap_s)
        prefix = f"{bucket_path}/raw-{uuid.uuid4().hex[:8]}"
        t0, wall0 = time.perf_counter(), time.time()
        fs.pipe({f"{prefix}/{name}": data for name, data in blobs.items()})
        times.append(time.perf_counter() - t0)
        if spans is not None:
            spans.append((wall0, time.time()))
        fs.rm(prefix, recursive=True)
    return times


def beside_steps(step_s: float, raw_s: float, reps: int = RAW_REPS, gap_s: float = RAW_GAP_S,
                 warmup_steps: int = 5) -> int:
    """Steps for the run the raw writes go beside: the warm-up, then room for `reps` writes, each
    allowed 4 x its idle time (a busy machine slows it), with half as much again to spare."""
    return warmup_steps + math.ceil(1.5 * reps * (gap_s + 4 * raw_s) / step_s) + 5


def writes_inside(spans: list[tuple[float, float]], step_ends: list[float]) -> int:
    """How many writes started after the run's first step and ended before its last: writes
    made while it trained."""
    if not step_ends:
        return 0
    first, last = min(step_ends), max(step_ends)
    return sum(1 for a, b in spans if first < a and b < last)


def run_size(hidden: int, s3, cluster, work: str, step_log: str, rep: int,
             layout: dict = DEFAULT_LAYOUT) -> tuple[list[dict], dict]:
    """One elastic run at this size; its per-checkpoint records and the raw s3fs figure."""
    from elastic import Trainer

    p = plan(hidden)
    num_steps = p["every"] * (p["num_checkpoints"] + 1)  # the last counted checkpoint gets a whole period
    bench_uri = f"{s3.uri}/bench-checkpoint"
    open(step_log, "w").close()
    job = elastic_job(hidden, bench_uri, s3.storage_options, p["every"], num_steps, layout["num_workers"])
    result = Trainer(job).fit(progress=False)
    if result.events_of("recovered") or result.metrics["step"] != num_steps:
        raise RuntimeError(f"the run was not fault-free: {result.summary()}")
    lines = read_step_log(step_log)
    committed = result.events_of("checkpoint_committed")
    figs = checkpoint_figures(step_intervals([x["t"] for x in lines]), [e["step"] for e in committed],
                              warmup_steps=3, every=p["every"])
    fs = s3.filesystem()
    params = num_params(hidden)
    # Every checkpoint of the run holds the same tensors: the newest folder's bytes stand for each.
    newest = committed[-1]["uri"].split("://", 1)[1]
    blobs = {name: fs.cat_file(f"{newest}/{name}") for name in folder_files(fs, newest)}
    nbytes = sum(len(b) for b in blobs.values())
    records = []
    for e in committed:
        if e["step"] == num_steps:
            continue  # the final save: nothing trains after it, and the run waits for it
        records.append({"bench": "checkpoint", "system": "elastic", "params": params, "hidden": hidden, "rep": rep,
                        "step": e["step"], "stall_s": e.get("stall_s"), "persist_s": e["persist_s"],
                        "bytes": nbytes, "persist_MBps": nbytes / 1e6 / e["persist_s"],
                        "step_s": figs["step_s"], "extra_s": figs["extra_s"].get(e["step"]),
                        "period_extra_s": figs["period_extra_s"].get(e["step"]),
                        "every_steps": p["every"], "num_workers": layout["num_workers"],
                        "cpus_per_node": layout["cpus_per_node"], "global_batch": GLOBAL_BATCH,
                        "deferred": len(result.events_of("checkpoint_deferred"))})
    # raw s3fs: the newest committed folder's files, read into memory above (not timed).
    times = raw_write(fs, f"{s3.bucket}/bench-checkpoint", blobs, RAW_REPS)
    raw = {"bench": "checkpoint", "system": "raw-s3fs", "params": params, "hidden": hidden, "rep": rep,
           "num_workers": layout["num_workers"], "cpus_per_node": layout["cpus_per_node"],
           "bytes": nbytes, "files": len(blobs), "raw_s": times, "raw_s_median": statistics.median(times),
           "raw_MBps": nbytes / 1e6 / statistics.median(times)}
    fs.rm(f"{s3.bucket}/bench-checkpoint", recursive=True)
    raw.update(raw_beside_training(hidden, s3, fs, step_log, layout, blobs, figs["step_s"], raw["raw_s_median"]))
    return records, raw


def raw_beside_training(hidden: int, s3, fs, step_log: str, layout: dict, blobs: dict[str, bytes],
                        step_s: float, raw_s: float) -> dict:
    """The raw writes again, while a second run of the same training job goes on (no checkpoint
    until its end). Raises if a write fell outside the training."""
    from elastic import Trainer

    warmup = 5
    num_steps = beside_steps(step_s, raw_s, warmup_steps=warmup)
    open(step_log, "w").close()
    job = elastic_job(hidden, f"{s3.uri}/bench-checkpoint-beside", s3.storage_options, num_steps, num_steps,
                      layout["num_workers"])
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["result"] = Trainer(job).fit(progress=False)
        except BaseException as e:  # noqa: BLE001 - reported below, on the driver's thread
            outcome["error"] = e

    runner = threading.Thread(target=train, name="beside-training", daemon=True)
    runner.start()
    while runner.is_alive() and len(read_step_log(step_log)) < warmup:
        time.sleep(0.2)
    spans: list[tuple[float, float]] = []
    times = raw_write(fs, f"{s3.bucket}/bench-checkpoint-beside", blobs, RAW_REPS, RAW_GAP_S, spans)
    runner.join()
    if "error" in outcome:
        raise RuntimeError(f"the run beside the raw writes failed: {outcome['error']}") from outcome["error"]
    inside = writes_inside(spans, [x["t"] for x in read_step_log(step_log)])
    if inside != len(spans):
        raise RuntimeError(f"only {inside} of {len(spans)} raw writes ran while the training did "
                           f"({num_steps} steps); the run was too short")
    fs.rm(f"{s3.bucket}/bench-checkpoint-beside", recursive=True)
    nbytes = sum(len(b) for b in blobs.values())
    return {"raw_beside_s": times, "raw_beside_s_median": statistics.median(times),
            "raw_beside_MBps": nbytes / 1e6 / statistics.median(times), "beside_steps": num_steps,
            "raw_gap_s": RAW_GAP_S}


def main(args) -> int:
    from elastic.local_cluster import local_cluster
    from tests.support.seaweedfs import seaweedfs_server

    try:
        widths = parse_hidden(args.hidden or DEFAULT_HIDDEN)
    except ValueError as e:
        print(f"python -m benchmarks checkpoint: {e}", file=sys.stderr)
        return 2
    layout = SPARE_CORE_LAYOUT if args.spare_core else DEFAULT_LAYOUT
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="elastic-bench-checkpoint-")
    step_log = os.path.join(work, "steps.jsonl")
    records: list[dict] = []
    raws: dict[int, dict] = {}
    t_start = time.time()
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(seaweedfs_server(data_dir=os.path.join(work, "s3")))
        cluster = stack.enter_context(local_cluster(num_worker_nodes=layout["num_workers"],
                                                    cpus_per_node=layout["cpus_per_node"]))
        for hidden in widths:
            connect_with_env(cluster, {HIDDEN_ENV: str(hidden), STEP_LOG_ENV: step_log})
            cluster.ensure_worker_nodes(layout["num_workers"])
            recs, raw = run_size(hidden, s3, cluster, work, step_log, rep=0, layout=layout)
            for r in (*recs, raw):
                emit(r)
            print(f"[checkpoint] {num_params(hidden) / 1e6:.1f} M: stall "
                  + ", ".join(f"{r['stall_s']:.3f}" for r in recs if r["stall_s"] is not None)
                  + f" s; persist {statistics.median(r['persist_s'] for r in recs):.2f} s; raw "
                  f"{raw['raw_s_median']:.2f} s; raw beside training {raw['raw_beside_s_median']:.2f} s",
                  file=sys.stderr, flush=True)
            records += recs
            raws[raw["params"]] = raw
            if args.out:
                append_results(args.out, (*recs, raw))
    rows, table = summarise(records, raws)
    summary = {"bench": "checkpoint", "summary": True, "rows": rows, "stall_target_steps": STALL_TARGET,
               "persist_target": PERSIST_TARGET, "wall_s": time.time() - t_start}
    emit(summary)
    where = ("1 rank on a worker node of 2 CPUs (training on one compute thread, a core spare for the persist)"
             if args.spare_core else f"{NUM_WORKERS} ranks on the one-CPU worker nodes")
    notes = (f"elastic DDP, {where} of a local ray.cluster_utils.Cluster, "
             f"MLP 256 -> hidden -> hidden -> 10, AdamW (a checkpoint holds the model and both Adam moments), "
             f"global batch {GLOBAL_BATCH}; checkpoints to a SeaweedFS S3 endpoint on loopback through s3fs. "
             f"stall_s: rank 0's training thread held by the save; extra_s: the step after the save minus the "
             f"median step before any checkpoint; period_extra_s: the same summed over the checkpoint's period; persist: snapshot handed over -> committed; raw s3fs: the same files written by "
             f"one concurrent s3fs pipe() from the driver, median of {RAW_REPS}, once the run has ended (idle) "
             f"and beside a second run of the same training (each write after a {RAW_GAP_S:.0f} s pause). The "
             f"final checkpoint (which the run waits for) is left out.")
    title = "### checkpoint (stall and persist throughput vs raw s3fs, same run)\n\n"
    print(title + table + f"\n- {notes}")
    if args.out:
        append_markdown(args.out, title + table + f"\n- {notes}\n\n")
        command = (f"python -m benchmarks checkpoint --hidden {args.hidden or DEFAULT_HIDDEN}"
                   f"{' --spare-core' if args.spare_core else ''} --out {args.out}")
        with open(os.path.join(args.out, "checkpoint.json"), "w") as f:
            json.dump({"command": command, "notes": notes, **summary}, f, indent=2)
        plot(os.path.join(args.out, "checkpoint.png"), records, raws)
        print(f"wrote {args.out}/results.jsonl, results.md, checkpoint.json, checkpoint.png")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def plot(path: str, records: list[dict], raws: dict[int, dict]) -> None:
    """Left: each checkpoint's stall against the clean step time, per size. Right: persist and
    raw s3fs throughput per size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["params"] for r in records})
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for i, params in enumerate(sizes):
        mine = [r for r in records if r["params"] == params]
        a.scatter([i] * len(mine), [r["stall_s"] for r in mine], color="#1f4e79", s=16, zorder=3,
                  label="stall per checkpoint" if i == 0 else None)
        a.hlines(mine[0]["step_s"], i - 0.3, i + 0.3, color="#d62728", label="median step" if i == 0 else None)
        b.bar(i - 0.27, statistics.median(r["persist_MBps"] for r in mine), width=0.27, color="#8fb3d9",
              label="elastic persist" if i == 0 else None)
        b.bar(i, raws[params].get("raw_beside_MBps") or 0, width=0.27, color="#888888",
              label="raw s3fs beside training" if i == 0 else None)
        b.bar(i + 0.27, raws[params]["raw_MBps"], width=0.27, color="#bbbbbb",
              label="raw s3fs, idle" if i == 0 else None)
    labels = [f"{p / 1e6:.1f} M" for p in sizes]
    a.set_xticks(range(len(sizes)), labels)
    a.set_yscale("log")
    a.set_ylabel("seconds")
    a.set_title("stall per checkpoint vs step time", fontsize=9)
    a.legend(fontsize=7)
    b.set_xticks(range(len(sizes)), labels)
    b.set_ylabel("MB/s")
    b.set_title("persist throughput vs raw s3fs (same bytes)", fontsize=9)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
