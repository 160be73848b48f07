"""`python -m benchmarks recovery`: the common workload with rank 1's node killed (`--fault kill_node`)
or frozen (`--fault freeze_node`: SIGSTOP, no socket closes, as a machine that loses power) at a
fixed step, elastic and Ray Train side by side on the same local cluster, interleaved per
repetition.

Figures (docs/benchmarks/recovery.md): recover_s (fault -> first step completed by the recovered
group), lost_steps (steps done before the fault that were done again), detect_s (fault ->
the framework decided/noticed). On a user's own cluster the same code runs with --address.

The fault lands at a different offset from the last checkpoint in each repetition (FAULT_STEPS,
cycling), so that one system's report lag at one offset does not alone decide lost_steps.
`--params 900K,9M,90M` repeats the whole comparison at each model size (about 10 MB, 100 MB and
1 GB of model + AdamW state): every process of every system builds the same, wider MLP
(`elastic.workload`, through the job's runtime environment). `--storage s3` puts every
system's checkpoints on a SeaweedFS S3 endpoint (Ray Train's through the pyarrow S3 filesystem
its docs name), so the storage path pays for reading the state back over HTTP.

`--gpu`: every system trains on NCCL, one GPU per rank, on one worker node of the local cluster
that holds every GPU (see `gpu_layout`: NCCL refuses two ranks on one GPU, so one GPU means one
rank, rank 0 is the one faulted, and no survivor or warm spare can exist). The fault is
`--fault kill_process`: the rank's process dies, its node and GPU stay for the replacement.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid

from benchmarks.output import emit, medians, parse_systems, recovery_timeline, report_against_peer, scratch_dir
from benchmarks.pipeline import gpt_setup

NUM_WORKERS, NUM_STEPS, CKPT_EVERY, GLOBAL_BATCH = 3, 40, 10, 96
TP_GLOBAL_BATCH = 32  # --tp: examples/gpt.py's sequences (examples/gpt_3d.yaml's batch)
# The fault lands at a different offset from the last checkpoint (step 20) in each repetition, so
# that no peer's report lag at one offset alone decides lost_steps.
FAULT_STEPS = (25, 22, 28)
# state_in_place_s: fault -> the state restored on every rank (the `recovered` event's), and the
# rate its copy crossed at against the backend's raw rate for one buffer of that size, same run.
METRICS = ["recover_s", "state_in_place_s", "lost_steps", "detect_s", "moved_gb_per_s", "link_gb_per_s"]
LARGE_PARAMS = 50_000_000
STATE_BYTES_PER_PARAM = 12  # fp32 parameter + AdamW's two moments, as every system checkpoints them


GPU_FAULTS = ("kill_process",)


def gpu_layout(num_gpus: int) -> dict:
    """World size, faulted rank and the systems a `--gpu` run can compare on `num_gpus` GPUs: one
    rank per GPU, at most the CPU run's 3. With one rank there is no survivor, so elastic's default
    path is its storage path (elastic-storage would be the same run again); a warm spare needs a
    GPU of its own beside the ranks."""
    from benchmarks.overhead import gpu_world_size
    world = gpu_world_size(num_gpus, NUM_WORKERS)
    systems = (["elastic-storage"] if world > 1 else []) + ["elastic"]
    systems += ["elastic-spare"] if num_gpus > world else []
    return {"num_workers": world, "fault_rank": 1 if world > 1 else 0, "systems": systems + ["ray-train"]}


def fault_step(rep: int) -> int:
    return FAULT_STEPS[rep % len(FAULT_STEPS)]


def parse_params(arg: str | None) -> list[int | None]:
    """`--params 0.9M,9M,90M`: model sizes (parameters; K, M, G suffixes). None: the common workload."""
    if not arg:
        return [None]
    out = []
    for v in (x.strip() for x in arg.split(",") if x.strip()):
        mult = {"K": 1e3, "M": 1e6, "G": 1e9}.get(v[-1:].upper(), 1)
        try:
            n = float(v[:-1] if mult != 1 else v) * mult
        except ValueError:
            raise ValueError(f"--params: expected sizes like 900K, 9M or 90M, comma-separated, got {v!r}") from None
        if n < 10_000:
            raise ValueError(f"--params: {v} is too small for the MLP (at least 10K parameters)")
        out.append(int(n))
    if not out:
        raise ValueError(f"--params: expected sizes like 900K, 9M or 90M, got {arg!r}")
    return out


def hidden_for(params: int) -> int:
    """The MLP's hidden width whose parameter count is nearest `params` (h^2 + 268 h + 10)."""
    from benchmarks.overhead import num_params
    h = max(1, round((-268 + (268 ** 2 + 4 * (params - 10)) ** 0.5) / 2))
    return min((h - 1, h, h + 1), key=lambda w: abs(num_params(max(w, 1)) - params))


def model_size(size: int | None) -> tuple[int | None, int]:
    """(hidden width to set, or None for the common workload's; its parameter count) of a --params size."""
    from benchmarks.overhead import num_params
    from elastic.workload import HIDDEN
    hidden = hidden_for(size) if size else None
    return hidden, num_params(hidden or HIDDEN)


# elastic's recovery paths, each a system of its own in the table.
ELASTIC_SYSTEMS = {
    "elastic-storage": ({"num_workers": NUM_WORKERS}, {"peer_restore": False}),  # reload from storage
    "elastic": ({"num_workers": NUM_WORKERS}, {}),  # survivors' memory + a worker started on demand
    "elastic-spare": ({"num_workers": NUM_WORKERS, "num_spares": 1, "wait_for_spares": True}, {}),  # warm spare
    # A pre-started worker on every node (elastic/group/prestart.py), up before training starts
    "elastic-prestart": ({"num_workers": NUM_WORKERS, "prestarted_per_node": 1, "wait_for_spares": True}, {}),
    # Opt-in: `elastic` judged by its polls alone (no heartbeat sidecar,
    # elastic/runtime/heartbeat.py)
    "elastic-no-heartbeat": ({"num_workers": NUM_WORKERS}, {"heartbeat": False}),
}
SYSTEMS = ["elastic-storage", "elastic", "elastic-spare", "ray-train"]  # the default run
# Opt-in (`--systems ...,ray-train-torchft`): needs torchft (`pip install -c constraints.txt -e '.[bench]'`)
# and a cluster of its own whose head has a CPU for torchft's lighthouse.
TORCHFT = "ray-train-torchft"
TORCHFT_TIMEOUT_S = 300.0  # a torchft run that has not finished by then is reported as hung, with its timeline


TP_GPT = "4,256,64"  # --tp: GPT_LAYERS,GPT_DIM,GPT_CONTEXT of examples/gpt.py (parallel's default)


def tp_layout(tp: int) -> dict:
    """`--tp T`: examples/gpt.py on dp 2 x tp T ranks of half a CPU (a tp group of 2 fits one
    one-CPU node, as examples/gpt_3d.yaml asks), rank 1's node (its whole tp group, replica 0)
    lost; a warm spare per lost rank."""
    return {"num_workers": 2 * tp, "fault_rank": 1, "cpus_per_worker": 0.5, "spares": tp}


def elastic_job(system: str, storage_uri: str, storage_options: dict, fault: str = "kill_node",
                at_step: int = FAULT_STEPS[0], num_workers: int = NUM_WORKERS, fault_rank: int = 1,
                gpu: bool = False, strategy: str = "ddp", tp: int = 1, copy_budget: float | None = None,
                copy_sync: bool = False) -> dict:
    """The job of one elastic system. `strategy` fsdp: the state is sharded, and a fault restores
    from the in-memory copies at their default budget, or `copy_budget` (checkpoint.memory_max_overhead;
    elastic-storage: from the checkpoint), or a copy every step waited for (`copy_sync`:
    checkpoint.memory_sync). `tp` > 1: examples/gpt.py split over tp ranks by the
    built-in plan (tp_layout)."""
    scaling, failure = ELASTIC_SYSTEMS[system]
    train = {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
             "loss": "elastic.workload:loss_fn", "optimizer": "elastic.workload:build_optimizer",
             "global_batch_size": GLOBAL_BATCH, "strategy": strategy}
    if tp > 1:
        lay = tp_layout(tp)
        scaling = {**scaling, "cpus_per_worker": lay["cpus_per_worker"]}
        if scaling.get("num_spares"):
            scaling["num_spares"] = lay["spares"]
        train.update(model="examples.gpt:build_model", dataset="examples.gpt:build_dataset",
                     loss="examples.gpt:loss_fn", optimizer="examples.gpt:build_optimizer",
                     global_batch_size=TP_GLOBAL_BATCH, tp={"size": tp})
    return {
        "run": {"name": f"bench-recovery-{uuid.uuid4().hex[:8]}", "num_steps": NUM_STEPS, "seed": 0},
        "scaling": {**scaling, "num_workers": num_workers, "use_gpu": gpu},
        "failure": {"max_failures": 3, **failure},
        "checkpoint": {"storage_uri": storage_uri, "storage_options": storage_options, "every_steps": CKPT_EVERY,
                       **({"memory_max_overhead": copy_budget} if copy_budget is not None else {}),
                       **({"memory_sync": True} if copy_sync and system != "elastic-storage" else {})},
        "train": train,
        "chaos": [{"action": fault, "rank": fault_rank, "at_step": at_step}],
    }


def run_elastic(system: str, storage_uri: str, storage_options: dict, fault: str, at_step: int,
                num_workers: int = NUM_WORKERS, fault_rank: int = 1, gpu: bool = False, strategy: str = "ddp",
                tp: int = 1, copy_budget: float | None = None, copy_sync: bool = False) -> dict:
    from elastic import Trainer
    t0 = time.time()
    job = elastic_job(system, storage_uri, storage_options, fault, at_step, num_workers, fault_rank, gpu, strategy,
                      tp, copy_budget, copy_sync)
    result = Trainer(job).fit(progress=False)
    rec = result.events_of("recovered")
    r = rec[0] if rec else {}
    restored = result.events_of("restored")[-1]
    (plan,) = result.events_of("restore_plan") or ({},)
    return {"bench": "recovery", "system": system, "strategy": strategy, "tp": tp, "fault": fault,
            "copy_budget": job["checkpoint"].get("memory_max_overhead"),
            "copy_sync": job["checkpoint"].get("memory_sync", False),
            "recover_s": r.get("recover_s"), "restore_source": restored["source"],
            "restore_plan": plan.get("reason"),
            "lost_steps": r.get("lost_steps"), "detect_s": r.get("detect_s"), "fault_step": r.get("fault_step"),
            "resumed_step": r.get("resumed_step"), "final_step": result.metrics["step"],
            "total_s": time.time() - t0, "num_workers": num_workers, "ckpt_every": CKPT_EVERY,
            # Every rank's digest equal (DDP), or each tp slot's across replicas (DDP x TP).
            "replicas_identical": len({d for r, d in result.digests.items() if r % tp == 0}) == 1,
            "run_dir": result.run_dir,
            # Survivors replaced instead of kept (their state lost), and persists they left running.
            "survivors_replaced": len(result.events_of("worker_replaced")),
            "persists_abandoned": len(result.events_of("persist_abandoned")),
            # Judged with the heartbeat or by polls alone (detect_s is how long the silence took).
            "heartbeat": job["failure"].get("heartbeat", True),
            "silence_excused": len(result.events_of("silence_excused")),
            **recovery_timeline(result)}


def run_ray_train(storage_dir: str, fault: str, at_step: int, s3=None, num_workers: int = NUM_WORKERS,
                  fault_rank: int = 1, gpu: bool = False, strategy: str = "ddp", tp: int = 1) -> dict:
    from benchmarks.ray_train_peer import run_ray_train_recovery
    extra = {"tp": tp, "cpus_per_worker": tp_layout(tp)["cpus_per_worker"]} if tp > 1 else {}
    return run_ray_train_recovery(storage_dir=storage_dir, num_workers=num_workers, num_steps=NUM_STEPS,
                                  fault_step=at_step, ckpt_every=CKPT_EVERY,
                                  global_batch_size=TP_GLOBAL_BATCH if tp > 1 else GLOBAL_BATCH,
                                  fault=fault, s3=s3, fault_rank=fault_rank, use_gpu=gpu, strategy=strategy, **extra)


def main(args) -> int:
    from elastic.local_cluster import local_cluster
    from benchmarks.overhead import connect_with_env
    from elastic.workload import HIDDEN_ENV

    gpu = bool(getattr(args, "gpu", False))
    strategy = getattr(args, "strategy", "ddp") or "ddp"
    if strategy == "fsdp" and TORCHFT in (args.systems or ""):
        print(f"python -m benchmarks recovery: --strategy fsdp: {TORCHFT} runs DDP only here", file=sys.stderr)
        return 2
    tp = getattr(args, "tp", 1) or 1
    if tp > 1:
        problem = ("--gpu" if gpu else "--params (MLP sizes; --gpt sizes the model)" if args.params
                   else f"--systems {TORCHFT}" if TORCHFT in (args.systems or "") else None)
        if tp != 2 or problem:
            print(f"python -m benchmarks recovery: --tp {tp}: " + (f"not with {problem}" if problem else
                  "only 2 here (a tp group on one of the cluster's one-CPU nodes)"), file=sys.stderr)
            return 2
        try:
            gpt, gpt_params = gpt_setup(args.gpt or TP_GPT)
        except ValueError as e:
            print(f"python -m benchmarks recovery: {e}", file=sys.stderr)
            return 2
    layout = {"num_workers": NUM_WORKERS, "fault_rank": 1, "systems": SYSTEMS}
    if tp > 1:
        layout = {**layout, "num_workers": tp_layout(tp)["num_workers"]}
    elif gpu:
        from benchmarks.overhead import gpu_devices
        try:
            num_gpus = gpu_devices()
            layout = gpu_layout(num_gpus)
        except ValueError as e:
            print(f"python -m benchmarks recovery: {e}", file=sys.stderr)
            return 2
    world, fault_rank = layout["num_workers"], layout["fault_rank"]
    systems = parse_systems("recovery", args.systems or ",".join(layout["systems"]),
                            layout["systems"] if gpu else [*SYSTEMS, "elastic-prestart", "elastic-no-heartbeat", TORCHFT])
    if systems is None:
        return 2
    if TORCHFT in systems:
        try:
            import torchft  # noqa: F401
        except ImportError:
            print(f"python -m benchmarks recovery: --systems {TORCHFT} needs torchft: "
                  f"pip install -c constraints.txt -e '.[bench]'", file=sys.stderr)
            return 2
    faults = [f.strip() for f in args.fault.split(",") if f.strip()]
    if gpu:
        if not faults or set(faults) - set(GPU_FAULTS):
            print(f"python -m benchmarks recovery: --gpu: expected --fault {', '.join(GPU_FAULTS)} (the node holds the GPUs, "
                  f"so it must outlive the fault), got {args.fault!r}", file=sys.stderr)
            return 2
    elif not faults or set(faults) - {"kill_node", "freeze_node", "kill_process"}:
        print(f"python -m benchmarks recovery: --fault: expected kill_node, freeze_node, kill_process (comma-separated), "
              f"got {args.fault!r}", file=sys.stderr)
        return 2
    try:
        sizes = parse_params(args.params)
    except ValueError as e:
        print(f"python -m benchmarks recovery: {e}", file=sys.stderr)
        return 2
    records: list[dict] = []
    work = scratch_dir("elastic-bench-")
    with contextlib.ExitStack() as stack:
        storage_uri, storage_options, s3 = "file://" + os.path.join(work, "runs"), {}, None
        if args.storage == "s3":
            from tests.support.seaweedfs import seaweedfs_server
            s3 = stack.enter_context(seaweedfs_server())
            storage_uri, storage_options = f"{s3.uri}/bench", s3.storage_options
        if gpu:  # one node holding every GPU (see local_cluster), a CPU per rank and one for a replacement
            num_nodes = 1
            cluster = stack.enter_context(local_cluster(num_worker_nodes=1, cpus_per_node=world + 1,
                                                        gpus_per_node=num_gpus))
        else:
            num_nodes = NUM_WORKERS + 1
            cluster = stack.enter_context(local_cluster(num_worker_nodes=num_nodes, cpus_per_node=1))
        for size in sizes:
            hidden, params = model_size(size)
            if hidden:  # every process of every system builds this width (elastic.workload)
                connect_with_env(cluster, {HIDDEN_ENV: str(hidden)})
            if tp > 1:  # every process of every system builds this examples/gpt.py
                params = gpt_params
                connect_with_env(cluster, gpt)
            link = link_speed(params * STATE_BYTES_PER_PARAM, gpu)
            # From LARGE_PARAMS on a step takes seconds here and a checkpoint a gigabyte: --reps-large (1).
            for rep in range(getattr(args, "reps_large", 1) if params >= LARGE_PARAMS else args.reps):
                at_step = fault_step(rep)
                for fault in faults:
                    for system in [s for s in systems if s != TORCHFT]:  # interleaved: drift hits all alike
                        cluster.ensure_worker_nodes(num_nodes)
                        if system == "ray-train":
                            rec = run_ray_train(work, fault, at_step, s3, world, fault_rank, gpu, strategy, tp)
                            if rec.get("sanity"):  # kept and shown: a figure to read with its problems
                                print(f"ray-train result is not a fair figure: {rec['sanity']}", file=sys.stderr)
                        else:
                            rec = {**run_elastic(system, storage_uri, storage_options, fault, at_step, world,
                                                 fault_rank, gpu, strategy, tp, getattr(args, "copy_budget", None),
                                                 bool(getattr(args, "copy_sync", False))),
                               "storage": args.storage}
                        rec["backend"] = "nccl" if gpu else "gloo"
                        rec.update(rep=rep, params=params, state_MB=params * STATE_BYTES_PER_PARAM / 1e6,
                                   fault_offset=at_step % CKPT_EVERY, link_gb_per_s=link)
                        records.append(rec)
                        emit(rec)
    if TORCHFT in systems:  # after the shared cluster is gone: one cluster at a time
        records += run_torchft_all(sizes, faults, args.reps, work, getattr(args, "reps_large", 1))
    for size in sizes:
        params = gpt_params if tp > 1 else model_size(size)[1]
        for fault in faults:
            mine = [r for r in records if r["fault"] == fault and r["params"] == params]
            med = medians(mine, METRICS)
            if gpu:
                from benchmarks.overhead import gpu_info
                info = gpu_info()
                where = (f"{world} worker{'s' if world > 1 else ''} on NCCL, one GPU each ({info['gpu']}, driver "
                         f"{info.get('driver')}, torch {info['torch']}; NCCL refuses two ranks on one GPU), on one "
                         f"node of a local ray.cluster_utils.Cluster holding the GPUs, ")
            elif tp > 1:
                where = (f"{world} workers of half a CPU on {NUM_WORKERS + 1} one-CPU nodes (local "
                         f"ray.cluster_utils.Cluster), ")
            else:
                where = f"{NUM_WORKERS} workers + 1 spare node (local ray.cluster_utils.Cluster, 1 CPU each), "
            what = {"kill_node": "node killed", "freeze_node": "node frozen (SIGSTOP)",
                    "kill_process": "process killed (SIGKILL; node and GPU stay)"}[fault]
            model = (f"examples/gpt.py at GPT_LAYERS,GPT_DIM,GPT_CONTEXT={args.gpt or TP_GPT}, dp 2 x tp {tp} "
                     f"ranks of half a CPU, {params / 1e6:.1f} M params" if tp > 1 else f"MLP {params / 1e6:.1f} M params")
            notes = [where +
                     f"{model} ({params * STATE_BYTES_PER_PARAM / 1e6:.0f} MB of model + "
                     f"AdamW state), global batch {TP_GLOBAL_BATCH if tp > 1 else GLOBAL_BATCH}, checkpoint every "
                     f"{CKPT_EVERY} steps to "
                     f"{'S3 (SeaweedFS)' if s3 else 'local disk'} for every system, rank {fault_rank}'s "
                     f"{what} after step "
                     f"{', '.join(str(s) for s in dict.fromkeys(r['fault_step'] for r in mine if r.get('fault_step')))}"
                     f" (one per repetition, cycling through {', '.join(map(str, FAULT_STEPS))})"]
            if tp > 1:
                notes.append(f"rank {fault_rank}'s node holds the whole tp group of replica 0; elastic copies it from "
                             f"the other replica's memory (ddp) or its in-memory copies (fsdp), a warm spare per lost "
                             f"rank for elastic-spare; Ray Train runs the same split model in TorchTrainer "
                             f"(benchmarks/ray_train_tp.py) with distributed checkpoints")
            if strategy != "ddp":
                budget = getattr(args, "copy_budget", None)
                at = ("their default budget" if budget is None else
                      f"checkpoint.memory_max_overhead {budget:g}" + (" (a copy every step)" if budget >= 1 else ""))
                if getattr(args, "copy_sync", False):
                    at = "a copy every step, each in before its step is reported (checkpoint.memory_sync)"
                notes.append(f"every system trains with {strategy}: elastic FSDP2 with in-memory copies at {at} "
                             f"(elastic-storage: the checkpoint), Ray Train FSDP2 with distributed "
                             f"checkpointing (benchmarks/ray_train_fsdp.py)")
            title = (f"recovery ({fault}, {params / 1e6:.1f} M params{', ' + strategy if strategy != 'ddp' else ''}"
                     f"{f' x tp {tp}' if tp > 1 else ''})")
            report_against_peer("recovery", title, mine, med, METRICS,
                                list(ELASTIC_SYSTEMS), "ray-train", notes, args.out)
    if args.out and len(sizes) > 1:
        plot_by_size(os.path.join(args.out, "recovery-by-size.png"), records)
    return 0


def link_speed(nbytes: int, gpu: bool) -> float | None:
    """The backend's raw rate (GB/s) for one buffer of the state's size between two ranks of this
    machine (benchmarks/probes/link_speed.py), measured in this run; None where it cannot run
    (NCCL with fewer than 2 GPUs) or failed (said on stderr: the recovery figures stand alone)."""
    import torch

    from benchmarks.probes.link_speed import measure
    if gpu and torch.cuda.device_count() < 2:
        return None
    try:
        out = measure(nbytes, "nccl" if gpu else "gloo", reps=3)
    except Exception as e:  # noqa: BLE001 - a reference figure, not the benchmark's own
        print(f"python -m benchmarks recovery: the link probe failed: {e}", file=sys.stderr)
        return None
    print(f"link: {nbytes / 1e6:.0f} MB sent rank to rank at {out['gb_per_s']} GB/s ({out['backend']}, "
          f"{out['s']} s)", file=sys.stderr)
    return out["gb_per_s"]


def run_torchft_all(sizes: list[int | None], faults: list[str], reps: int, work: str,
                    reps_large: int = 1) -> list[dict]:
    """The torchft peer, each run on a fresh cluster whose head has a CPU for the lighthouse. A run
    that fails or hangs is a record with recover_s None and the evidence, never a figure."""
    from elastic.local_cluster import local_cluster
    from benchmarks.overhead import connect_with_env
    from benchmarks.torchft_peer import run_torchft_recovery
    from elastic.workload import HIDDEN_ENV

    out = []
    for size in sizes:
        hidden, params = model_size(size)
        for rep in range(reps_large if params >= LARGE_PARAMS else reps):
            at_step = fault_step(rep)
            for fault in faults:
                with local_cluster(num_worker_nodes=NUM_WORKERS + 1, cpus_per_node=1, head_cpus=1) as cluster:
                    if hidden:
                        connect_with_env(cluster, {HIDDEN_ENV: str(hidden)})
                    try:
                        rec = run_torchft_recovery(work, NUM_WORKERS, NUM_STEPS, at_step, CKPT_EVERY, GLOBAL_BATCH,
                                                   fault, cluster, timeout_s=TORCHFT_TIMEOUT_S)
                    except RuntimeError as e:
                        rec = {"bench": "recovery", "system": TORCHFT, "fault": fault, "recover_s": None,
                               "lost_steps": None, "detect_s": None, "error": str(e)[:3000]}
                rec.update(rep=rep, params=params, state_MB=params * STATE_BYTES_PER_PARAM / 1e6, storage="file",
                           fault_offset=at_step % CKPT_EVERY)
                out.append(rec)
                emit(rec)
    return out


def plot_by_size(path: str, records: list[dict]) -> None:
    """recover_s against the state's size, one line per system (medians, dots: repetitions)."""
    import statistics

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for system in dict.fromkeys(r["system"] for r in records):
        mine = [r for r in records if r["system"] == system and r.get("recover_s") is not None]
        sizes = sorted({r["state_MB"] for r in mine})
        if not sizes:
            continue
        meds = [statistics.median(r["recover_s"] for r in mine if r["state_MB"] == s) for s in sizes]
        line, = ax.plot(sizes, meds, marker="o", label=system)
        ax.scatter([r["state_MB"] for r in mine], [r["recover_s"] for r in mine], s=8, color=line.get_color(),
                   alpha=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("model + optimizer state (MB)")
    ax.set_ylabel("recover_s")
    ax.set_title("recovery time against state size (line: median)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
