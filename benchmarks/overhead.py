"""`python -m benchmarks overhead`: what the framework costs in steady state. Steps/s of elastic's DDP
divided by plain torch DDP (`benchmarks.plain_ddp`: torchrun processes and
`DistributedDataParallel`, no framework) and by Ray Train (`TorchTrainer` + `prepare_model`,
as Ray's docs write it), at several model sizes, in one run on one local cluster.

Every system trains the same MLP (`workload.build_mlp`: the common workload's shape, 256 -> hidden ->
hidden -> 10, so the hidden width sets the size: 1024 is 1.3 M parameters, 3072 is 10.3 M,
10000 is 102.7 M), on the same data path (the common workload's map-style dataset,
`default_collate` of the indices elastic's global sample order gives each rank), with 2 ranks
(elastic and Ray Train on the two one-CPU worker nodes of a local cluster; torchrun's two
processes beside it), the same global batch, AdamW, and one compute thread per rank.

Checkpoints every CKPT_EVERY steps, each system through its own usual path: elastic's
(an in-memory snapshot, then DCP to local disk in the background), the DDP tutorial's
(rank 0 `torch.save`s model and optimizer to local disk), Ray Train's (rank 0 `torch.save`s
into a folder and reports it with `ray.train.report`, every rank reports). One run per system
gives all three figures:

* checkpoints off: the steps after the warm-up and up to the first checkpoint (nothing has been
  checkpointed or is in flight yet), the median time per step;
* checkpoints every CKPT_EVERY steps: whole checkpoint periods from the first checkpoint on,
  the mean time per step (a median would skip the checkpoint steps);
* whole run: every step after the first, warm-up and checkpoints included, the mean time per
  step: what a system pays once (elastic makes its checkpoint staging buffers after the first
  step, in the warm-up) counts here too.

Steps are timed the same way in every system: an optimizer post-step hook on global rank 0
(`timed_optimizer`) appends each step's end time to a file (on a GPU after synchronising, so a
step counts when it is done, not when it is queued). Systems run interleaved within each
repetition (their order rotates); the ratios are of medians of the same run.

`--gpu`: the same comparison on NCCL, one GPU per rank (elastic's `scaling.use_gpu`, torchrun's
processes on cuda:LOCAL_RANK, Ray Train's `use_gpu=True`), every batch collated on the CPU and
copied to the GPU. NCCL refuses two ranks on one GPU, so the world size is the smaller of 2 and
the machine's GPUs; the local cluster is one worker node holding every GPU. Every size gets
`--reps` repetitions (a 102.7 M step takes milliseconds there).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from benchmarks.output import append_markdown, append_results, emit, int_list, medians, parse_systems
from benchmarks.plain_pipeline import StepClock  # the same step clock in every benchmark
from elastic.workload import HIDDEN_ENV, build_mlp, build_model  # noqa: F401 - one MLP for every system

NUM_WORKERS, GLOBAL_BATCH, SEED, CKPT_EVERY = 2, 96, 0, 50
DEFAULT_HIDDEN = "1024,3072,10000"
SYSTEMS = ["elastic", "torch-ddp", "ray-train", "elastic-fsdp", "elastic-fsdp-sync", "elastic-fsdp-nocopies"]
DEFAULT_SYSTEMS = "elastic,torch-ddp,ray-train"  # the FSDP pair measures the in-memory copies (--systems)
PEER = "torch-ddp"
TARGET = 0.97  # issue 9: at least this fraction of torch DDP's steps/s at every size
LARGE_PARAMS = 50_000_000  # from here on: a shorter warm-up and `--reps-large` repetitions
STEP_LOG_ENV = "ELASTIC_BENCH_STEP_LOG"  # file that global rank 0 appends one line per optimizer step to
OPTIMIZER_ENV = "ELASTIC_BENCH_OPTIMIZER"  # adamw (the default) or adamw-fused, for every system
MODES = ("off", f"every {CKPT_EVERY}", "whole run")


# ---------------------------------------------------------------- the workload (every system)
def num_params(hidden: int) -> int:
    from elastic import workload
    i, c = workload.IN_FEATURES, workload.NUM_CLASSES
    return i * hidden + hidden + hidden * hidden + hidden + hidden * c + c


def timed_optimizer(params):
    """The common workload's AdamW, with the step clock when ELASTIC_BENCH_STEP_LOG is set.
    elastic's job names it as `train.optimizer`; the peers call it directly. With
    ELASTIC_BENCH_OPTIMIZER=adamw-fused (benchmarks/gpu_check.sh), torch's fused AdamW in every
    system: the kernel whose found_inf lets elastic's step decide its update on the device."""
    import torch

    from elastic import workload
    chosen = os.environ.get(OPTIMIZER_ENV, "adamw")
    if chosen not in ("adamw", "adamw-fused"):
        raise ValueError(f"{OPTIMIZER_ENV}={chosen!r}: give adamw or adamw-fused")
    if chosen == "adamw-fused":
        optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    else:
        optimizer = workload.build_optimizer(params)
    path = os.environ.get(STEP_LOG_ENV)
    if path:
        optimizer.register_step_post_hook(StepClock(path))
    return optimizer


def gpu_devices() -> int:
    """CUDA devices torch sees on this machine (the driver's; every rank runs here too)."""
    import torch
    return torch.cuda.device_count()


def gpu_info() -> dict:
    """What a GPU figure needs beside it: the device, its driver, torch and NCCL."""
    import torch
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        info["driver"] = out[0] if out else None
    return info


# ---------------------------------------------------------------- plan and figures (pure)
def parse_hidden(arg: str) -> list[int]:
    """`--hidden 1024,3072,10000`: the MLP widths, one model size each."""
    return int_list("--hidden", arg)


def gpu_world_size(num_gpus: int, cpu_world: int = NUM_WORKERS) -> int:
    """Ranks of a `--gpu` run: one GPU each (NCCL refuses two ranks on one device), at most the
    CPU run's world size."""
    if num_gpus < 1:
        raise ValueError("--gpu: torch sees no CUDA device on this machine")
    return min(cpu_world, num_gpus)


def plan(hidden: int, reps: int, gpu: bool = False, reps_large: int = 1) -> dict:
    """Steps, warm-up steps and repetitions for one size: two checkpoint periods (the first
    without a checkpoint, the second from the first checkpoint on). From LARGE_PARAMS on a CPU
    step takes seconds (one repetition of the three systems, about 9 minutes here), so a shorter
    warm-up and `reps_large` repetitions (`--reps-large`, default 1); on a GPU every size gets
    the same plan."""
    large = not gpu and num_params(hidden) >= LARGE_PARAMS
    return {"num_steps": 2 * CKPT_EVERY, "warmup_steps": 5 if large else 10, "reps": reps_large if large else reps}


def step_figures(times: list[float], warmup_steps: int, ckpt_every: int) -> dict[str, dict]:
    """The three figures from one run's step-end times (t[s-1] ends step s; the checkpoint of step
    s is taken after t[s-1], so it lies in the interval that ends at step s + 1).

    off: the steps after the warm-up, warmup+1 .. ckpt_every (no checkpoint yet): median.
    on: from the end of step ckpt_every to the end of the last whole period: mean, so every
    interval with a checkpoint (and whatever it leaves running) counts.
    whole run: from the end of step 1 to the end of the last step: mean, warm-up included."""
    ts = sorted(times)
    n = len(ts)
    if not 1 <= warmup_steps < ckpt_every - 2 or n < 2 * ckpt_every:
        raise ValueError(f"{n} step times with {warmup_steps} warm-up steps: need 1 <= warm-up < "
                         f"{ckpt_every - 2} and at least {2 * ckpt_every} steps (one whole checkpoint period)")
    off = [b - a for a, b in zip(ts[warmup_steps - 1:ckpt_every - 1], ts[warmup_steps:ckpt_every])]
    last = (n // ckpt_every) * ckpt_every  # the end of the last whole period
    on = [b - a for a, b in zip(ts[ckpt_every - 1:last - 1], ts[ckpt_every:last])]
    run = [b - a for a, b in zip(ts[:-1], ts[1:])]
    return {
        "off": {"step_s": statistics.median(off), "mean_step_s": statistics.mean(off),
                   "median_step_s": statistics.median(off), "timed_steps": len(off), "num_checkpoints": 0},
        f"every {ckpt_every}": {"step_s": statistics.mean(on), "mean_step_s": statistics.mean(on),
                   "median_step_s": statistics.median(on), "max_step_s": max(on), "timed_steps": len(on),
                   "num_checkpoints": len(on) // ckpt_every},
        "whole run": {"step_s": statistics.mean(run), "mean_step_s": statistics.mean(run),
                      "median_step_s": statistics.median(run), "max_step_s": max(run), "timed_steps": len(run),
                      "num_checkpoints": (n - 1) // ckpt_every},
    }


def read_step_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_figures(lines: list[dict], num_steps: int, warmup_steps: int) -> dict[str, dict]:
    if len(lines) != num_steps:
        raise RuntimeError(f"the step log has {len(lines)} lines for {num_steps} steps: the step clock missed steps "
                           f"or another run wrote to it")
    figs = step_figures([x["t"] for x in lines], warmup_steps, CKPT_EVERY)
    for f in figs.values():
        f["steps_per_s"] = 1.0 / f["step_s"]
        f["threads"] = lines[-1]["threads"]
    return figs


def rotated(systems: list[str], rep: int) -> list[str]:
    """The systems' order in repetition `rep`: rotated, so that none always runs first."""
    k = rep % len(systems)
    return systems[k:] + systems[:k]


def elastic_job(hidden: int, num_steps: int, storage_uri: str, num_workers: int = NUM_WORKERS,
                gpu: bool = False, system: str = "elastic") -> dict:
    """elastic's job; `system` elastic-fsdp trains FSDP with its in-memory copies on (every step, the
    default, spaced to their budget), elastic-fsdp-sync with a copy every step waited for before
    the step is reported (checkpoint.memory_sync), elastic-fsdp-nocopies with them off
    (checkpoint.memory_every_steps 0)."""
    fsdp = system.startswith("elastic-fsdp")
    return {
        "run": {"name": f"bench-overhead-{uuid.uuid4().hex[:8]}", "num_steps": num_steps, "seed": SEED},
        "scaling": {"num_workers": num_workers, "use_gpu": gpu},
        "checkpoint": {"storage_uri": storage_uri, "every_steps": CKPT_EVERY,
                       "memory_every_steps": 0 if system == "elastic-fsdp-nocopies" else 1,
                       "memory_sync": system == "elastic-fsdp-sync"},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "optimizer": "benchmarks.overhead:timed_optimizer",
                  "global_batch_size": GLOBAL_BATCH, "strategy": "fsdp" if fsdp else "ddp"},
    }


def plain_command(hidden: int, num_steps: int, ckpt_dir: str, num_workers: int = NUM_WORKERS,
                  gpu: bool = False) -> list[str]:
    """torchrun launching the plain DDP peer, as torch's docs launch one."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_workers}",
            "-m", "benchmarks.plain_ddp", "--hidden", str(hidden), "--steps", str(num_steps),
            "--global-batch", str(GLOBAL_BATCH), "--seed", str(SEED), "--ckpt-every", str(CKPT_EVERY),
            "--ckpt-dir", ckpt_dir, *(["--gpu"] if gpu else [])]


# ---------------------------------------------------------------- the systems
def run_elastic(hidden: int, num_steps: int, work: str, num_workers: int = NUM_WORKERS, gpu: bool = False,
                system: str = "elastic") -> None:
    from elastic import Trainer
    runs = os.path.join(work, "elastic")
    result = Trainer(elastic_job(hidden, num_steps, "file://" + runs, num_workers, gpu, system)).fit(progress=False)
    shutil.rmtree(runs, ignore_errors=True)
    if result.events_of("recovered") or result.metrics["step"] != num_steps:
        raise RuntimeError(f"elastic's run was not fault-free: {result.summary()}")


def ray_worker_niceness() -> int:
    """The scheduling priority Ray gives its worker processes (raylet's `worker_niceness`, 15
    by default), read from a worker on a worker node."""
    import ray
    return ray.get(ray.remote(num_cpus=1)(lambda: os.getpriority(os.PRIO_PROCESS, 0)).remote())


def run_plain(hidden: int, num_steps: int, work: str, step_log: str, niceness: int, num_workers: int = NUM_WORKERS,
              gpu: bool = False) -> None:
    ckpt_dir = os.path.join(work, "torch-ddp")
    os.makedirs(ckpt_dir, exist_ok=True)
    # At the priority of Ray's workers (elastic's and Ray Train's ranks): on a machine shared
    # with other work, a rank at the default priority would take CPU from it that theirs cannot.
    increment = max(0, niceness - os.getpriority(os.PRIO_PROCESS, 0))
    cmd = ["nice", "-n", str(increment), *plain_command(hidden, num_steps, ckpt_dir, num_workers, gpu)]
    # One compute thread per rank, as Ray gives its one-CPU workers (torchrun sets this itself
    # only when it starts more than one process).
    env = {**os.environ, STEP_LOG_ENV: step_log, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if proc.returncode:
        raise RuntimeError(f"plain DDP failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")


CHECKPOINT_FILE = "state.pt"


def _ray_train_loop(config: dict) -> None:
    """The per-worker training function, as Ray Train's docs write one: `prepare_model` for DDP,
    and every `ckpt_every` steps rank 0 saves the model and optimizer into a folder it reports
    with `ray.train.report(checkpoint=...)` while the other ranks report metrics only."""
    import ray.train
    import torch
    from ray.train.torch import get_device, prepare_model
    from torch.utils.data import default_collate

    from elastic import workload
    from benchmarks.ray_train_peer import unwrapped
    from elastic.data.order import GlobalOrder

    os.environ[STEP_LOG_ENV] = config["step_log"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(config["seed"])
    model = prepare_model(build_mlp(config["hidden"]))  # DDP (gloo, or NCCL on GPU), rank 0's weights broadcast
    device = get_device()
    optimizer = timed_optimizer(model.parameters())
    dataset = workload.build_dataset()
    order = GlobalOrder(len(dataset), config["seed"])
    num_steps, every, global_batch = config["num_steps"], config["ckpt_every"], config["global_batch"]
    for step in range(num_steps):
        idx = order.rank_indices(step, global_batch, world, rank)
        batch = default_collate([dataset[j] for j in idx])
        if device.type == "cuda":
            batch = [t.to(device, non_blocking=True) for t in batch]
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        done = step + 1
        metrics = {"step": done}
        if done % every == 0:
            metrics["loss"] = float(loss.detach())
            if rank == 0:
                with tempfile.TemporaryDirectory() as tmp:
                    torch.save({"model": unwrapped(model).state_dict(), "optimizer": optimizer.state_dict(),
                                "step": done}, os.path.join(tmp, CHECKPOINT_FILE))
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            else:
                ray.train.report(metrics)
        elif done == num_steps:
            ray.train.report(metrics)


def run_ray_train(hidden: int, num_steps: int, work: str, step_log: str, num_workers: int = NUM_WORKERS,
                  gpu: bool = False) -> None:
    import ray.train
    from ray.train.torch import TorchTrainer

    storage = os.path.join(work, "ray-train")
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"hidden": hidden, "num_steps": num_steps, "ckpt_every": CKPT_EVERY,
                           "global_batch": GLOBAL_BATCH, "seed": SEED, "step_log": step_log},
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=gpu,
                                               resources_per_worker={"CPU": 1, **({"GPU": 1} if gpu else {})}),
        run_config=ray.train.RunConfig(storage_path=storage, name=f"bench-overhead-{uuid.uuid4().hex[:8]}"),
    )
    try:
        trainer.fit()
    finally:
        shutil.rmtree(storage, ignore_errors=True)


# ---------------------------------------------------------------- the run
def connect_with_env(cluster, env: dict[str, str]) -> None:
    """Reconnect the driver with a job-level runtime env: every actor of the job (elastic's
    workers, Ray Train's controller and workers) starts with these variables."""
    import logging

    import ray
    ray.shutdown()
    # Ray Train's workers log every report; the benchmark prints its own progress.
    ray.init(address=cluster.address, runtime_env={"env_vars": env}, logging_level=logging.WARNING,
             log_to_driver=False)


def add_ratios(records: list[dict]) -> None:
    """Each record's steps/s over the peer's in the same (size, mode, repetition)."""
    peer = {(r["params"], r["checkpoints"], r["rep"]): r for r in records if r["system"] == PEER}
    for r in records:
        p = peer.get((r["params"], r["checkpoints"], r["rep"]))
        if p is not None and r["system"] != PEER:
            r["overhead_ratio"] = r["steps_per_s"] / p["steps_per_s"]


def summarise(records: list[dict]) -> tuple[list[dict], str]:
    """Per (size, mode): every system's median steps/s and step_s, and elastic's and Ray Train's
    ratio to torch DDP (of the medians), plus the markdown table."""
    rows, lines = [], []
    lines += ["| parameters | checkpoints | system | reps | median step_s | median steps/s | steps/s ÷ torch DDP |",
              "|---|---|---|---|---|---|---|"]
    for params in dict.fromkeys(r["params"] for r in records):
        for mode in MODES:
            mine = [r for r in records if r["params"] == params and r["checkpoints"] == mode]
            med = medians(mine, ["step_s", "steps_per_s", "median_step_s", "overhead_ratio"])
            base = med.get(PEER, {}).get("steps_per_s")
            for system in [s for s in SYSTEMS if s in med]:
                m = med[system]
                ratio = m["steps_per_s"] / base if base and m["steps_per_s"] else None
                rows.append({"params": params, "checkpoints": mode, "system": system, "reps": m["n"],
                             "step_s": m["step_s"], "steps_per_s": m["steps_per_s"],
                             "overhead_ratio": ratio, "median_of_rep_ratios": m["overhead_ratio"]})
                cell = "1" if system == PEER else ("-" if ratio is None else f"{ratio:.3f}")
                lines.append(f"| {params / 1e6:.1f} M | {mode} | {system} | {m['n']} | {m['step_s']:.4g} | "
                             f"{m['steps_per_s']:.4g} | {cell} |")
    copies = copies_table(records)
    return rows, "\n".join(lines) + "\n" + (copies or "")


def copies_table(records: list[dict]) -> str | None:
    """FSDP with its in-memory copies against the same run without them: steps/s on ÷ off, of the
    medians, per size and mode (None unless both ran)."""
    ran = {r["system"] for r in records}
    if "elastic-fsdp-nocopies" not in ran or not ran & {"elastic-fsdp", "elastic-fsdp-sync"}:
        return None
    lines = ["", "| parameters | checkpoints | FSDP with in-memory copies | steps/s ÷ copies off, of the medians | per rep |",
             "|---|---|---|---|---|"]
    kinds = {"elastic-fsdp": "default budget, in the background", "elastic-fsdp-sync": "every step, memory_sync"}
    for params in dict.fromkeys(r["params"] for r in records):
        for mode in MODES:
            sel = [r for r in records if r["params"] == params and r["checkpoints"] == mode]
            off = {r["rep"]: r["steps_per_s"] for r in sel if r["system"] == "elastic-fsdp-nocopies"}
            for system, kind in kinds.items():
                on = {r["rep"]: r["steps_per_s"] for r in sel if r["system"] == system}
                reps = [on[k] / off[k] for k in sorted(on) if k in off]
                if reps:
                    ratio = statistics.median(on.values()) / statistics.median(off.values())
                    lines.append(f"| {params / 1e6:.1f} M | {mode} | {kind} | {ratio:.3f} | "
                                 f"{', '.join(f'{x:.3f}' for x in reps)} |")
    return "\n".join(lines) + "\n"


def plot(path: str, records: list[dict]) -> None:
    """steps/s ÷ torch DDP per size, one panel per checkpoint mode: bars are the ratio of the
    medians, dots the per-repetition ratios; the dashed line is the target."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["params"] for r in records))
    ours = [s for s in SYSTEMS if s != PEER and any(r["system"] == s for r in records)]
    colours = {"elastic": "#8fb3d9", "ray-train": "#d9b38f"}
    fig, axes = plt.subplots(1, len(MODES), figsize=(14, 3.8), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], MODES):
        for j, system in enumerate(ours):
            for i, params in enumerate(sizes):
                sel = [r for r in records if r["params"] == params and r["checkpoints"] == mode]
                mine = [r["steps_per_s"] for r in sel if r["system"] == system]
                peer = [r["steps_per_s"] for r in sel if r["system"] == PEER]
                if not mine or not peer:
                    continue
                x = i + (j - (len(ours) - 1) / 2) * 0.35
                ax.bar(x, statistics.median(mine) / statistics.median(peer), width=0.33, color=colours.get(system),
                       label=system if i == 0 else None)
                reps = [r["overhead_ratio"] for r in sel if r["system"] == system and r.get("overhead_ratio")]
                ax.scatter([x] * len(reps), reps, color="#1f4e79", zorder=3, s=12)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(TARGET, color="#b22222", lw=0.8, ls="--", label=f"target {TARGET}")
        ax.set_xticks(range(len(sizes)), [f"{p / 1e6:.1f} M" for p in sizes])
        ax.set_xlabel("parameters")
        ax.set_title(f"checkpoints {mode}" if mode != "whole run" else
                     f"whole run (checkpoints every {CKPT_EVERY}, warm-up included)", fontsize=9)
    axes[0][0].set_ylabel("steps/s ÷ torch DDP")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle("python -m benchmarks overhead (bar: ratio of medians, dots: per repetition)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    from elastic.local_cluster import local_cluster

    systems = parse_systems("overhead", args.systems or DEFAULT_SYSTEMS, list(SYSTEMS))
    if systems is None:
        return 2
    try:
        widths = parse_hidden(args.hidden or DEFAULT_HIDDEN)
    except ValueError as e:
        print(f"python -m benchmarks overhead: {e}", file=sys.stderr)
        return 2
    gpu = bool(getattr(args, "gpu", False))
    try:
        num_gpus = gpu_devices() if gpu else 0
        world = gpu_world_size(num_gpus) if gpu else NUM_WORKERS
    except ValueError as e:
        print(f"python -m benchmarks overhead: {e}", file=sys.stderr)
        return 2
    # CPU: one one-CPU node per rank. GPU: one node holding every GPU (see local_cluster), a CPU per rank.
    num_nodes = 1 if gpu else world
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="elastic-bench-overhead-")
    step_log = os.path.join(work, "steps.jsonl")
    records: list[dict] = []
    niceness = None
    t_start = time.time()
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(local_cluster(num_worker_nodes=num_nodes, cpus_per_node=world if gpu else 1,
                                                    gpus_per_node=num_gpus))
        for hidden in widths:
            p = plan(hidden, args.reps, gpu, getattr(args, "reps_large", 1))
            params = num_params(hidden)
            env = {HIDDEN_ENV: str(hidden), STEP_LOG_ENV: step_log}
            if OPTIMIZER_ENV in os.environ:  # every actor of the job trains with the same optimizer
                env[OPTIMIZER_ENV] = os.environ[OPTIMIZER_ENV]
            connect_with_env(cluster, env)
            if niceness is None:
                niceness = ray_worker_niceness()
            for rep in range(p["reps"]):
                group: list[dict] = []  # this size and repetition: every system, every mode
                for system in rotated(systems, rep):
                    cluster.ensure_worker_nodes(num_nodes)
                    open(step_log, "w").close()
                    t0 = time.time()
                    if system.startswith("elastic"):
                        run_elastic(hidden, p["num_steps"], work, world, gpu, system)
                    elif system == "torch-ddp":
                        run_plain(hidden, p["num_steps"], work, step_log, niceness, world, gpu)
                    else:
                        run_ray_train(hidden, p["num_steps"], work, step_log, world, gpu)
                    lines = read_step_log(step_log)
                    if args.out:  # the raw step times, for a closer look
                        os.makedirs(os.path.join(args.out, "steps"), exist_ok=True)
                        shutil.copy(step_log, os.path.join(args.out, "steps", f"{system}-{hidden}-{rep}.jsonl"))
                    figs = run_figures(lines, p["num_steps"], p["warmup_steps"])
                    for mode, f in figs.items():
                        rec = {"bench": "overhead", "system": system, "params": params, "hidden": hidden,
                               "checkpoints": mode, "rep": rep, **f, "num_steps": p["num_steps"],
                               "warmup_steps": p["warmup_steps"], "num_workers": world,
                               "backend": "nccl" if gpu else "gloo",
                               "global_batch": GLOBAL_BATCH, "niceness": niceness, "total_s": time.time() - t0}
                        group.append(rec)
                    print(f"[overhead] {params / 1e6:.1f} M rep {rep} {system}: "
                          + ", ".join(f"{m} {f['step_s']:.4f} s/step" for m, f in figs.items()),
                          file=sys.stderr, flush=True)
                # Out as soon as the group is complete, so a run cut short keeps what it measured.
                add_ratios(group)
                for r in group:
                    emit(r)
                if args.out:
                    append_results(args.out, group)
                records += group
    rows, table = summarise(records)
    summary = {"bench": "overhead", "summary": True, "rows": rows, "target": TARGET,
               "wall_s": time.time() - t_start, "num_workers": world, "backend": "nccl" if gpu else "gloo",
               **(gpu_info() if gpu else {})}
    emit(summary)
    if gpu:
        where = (f"{world} rank{'s' if world > 1 else ''} on NCCL, one GPU each ({summary['gpu']}; NCCL refuses two "
                 f"ranks on one GPU, so the world is min({NUM_WORKERS}, GPUs)), one compute thread each (elastic and "
                 f"Ray Train on a worker node of a local ray.cluster_utils.Cluster holding the GPUs, torch DDP as "
                 f"torchrun processes beside it); batches collated on the CPU and copied to the GPU")
    else:
        where = (f"{NUM_WORKERS} ranks on gloo with one compute thread each (elastic and Ray Train on "
                 f"the {NUM_WORKERS} one-CPU worker nodes of a local ray.cluster_utils.Cluster, torch DDP as torchrun "
                 f"processes beside it)")
    notes = (f"MLP 256 -> hidden -> hidden -> 10 (hidden {', '.join(map(str, widths))}), AdamW, global batch "
             f"{GLOBAL_BATCH}, {where}; data: the common workload's dataset, default_collate of elastic's global "
             f"order; every system checkpoints every {CKPT_EVERY} steps its own way. 'off' = median time of the "
             f"steps after the warm-up up to the first checkpoint; 'every {CKPT_EVERY}' = mean time per step over "
             f"whole checkpoint periods from the first checkpoint on; 'whole run' = mean time per step over every step "
             f"after the first (warm-up and one-time costs included). Timed by an optimizer post-step hook on "
             f"global rank 0{' after torch.cuda.synchronize()' if gpu else ''}; systems interleaved (rotated) per "
             f"repetition; ratios of medians of this run.")
    title = "### overhead (steady state, same run)\n\n"
    print(title + table + f"\n- {notes}")
    if args.out:
        append_markdown(args.out, title + table + f"\n- {notes}\n\n")
        command = (f"python -m benchmarks overhead --reps {args.reps} --hidden {args.hidden or DEFAULT_HIDDEN}"
                   + (f" --systems {args.systems}" if args.systems else "") + (" --gpu" if gpu else "")
                   + f" --out {args.out}")
        with open(os.path.join(args.out, "overhead.json"), "w") as f:
            json.dump({"command": command, "notes": notes, **summary}, f, indent=2)
        plot(os.path.join(args.out, "overhead.png"), records)
        print(f"wrote {args.out}/results.jsonl, results.md, overhead.json, overhead.png")
    shutil.rmtree(work, ignore_errors=True)
    return 0
