"""Where elastic's GPU step spends the time torch DDP's does not, and what FSDP's memory
techniques save on a GPU. One GPU, NCCL, world size 1, no Ray.

Step (default): the overhead benchmark's MLP, data and AdamW (`benchmarks.overhead`), trained in
this process by
  * plain: the loop of `benchmarks.plain_ddp` (DDP, `gradient_as_bucket_view`, a batch collated on
    the host and copied to the GPU), and
  * elastic: a real `Worker` (join, restore, run) with the overhead benchmark's job;
each timed over --steps steps by the same optimizer post-step clock (it synchronises, as the
benchmark's does), then profiled over --profile-steps steps by cProfile (Python functions) and
torch.profiler (operators and CUDA runtime calls). Prints one JSON line per system and writes the
profiles to --out.

Memory (--memory LAYERS,DIM,CONTEXT): elastic's FSDP on examples/gpt.py at world size 1, for CPU
offload x meta init x activation checkpointing (offload with meta init is refused by the config),
each in a fresh process: the GPU's peak allocated
and reserved bytes and the host's peak RSS over --memory-steps steps (no checkpoint). One JSON line each.

    python -m benchmarks.probes.gpu_step_profile [--hidden 1024] [--steps 200] [--out DIR]
    python -m benchmarks.probes.gpu_step_profile --memory 12,1536,256 [--out DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

WARMUP = 20
GPU = True  # --cpu: gloo on the CPU, to check the script on a machine without a GPU


def _sync() -> None:
    import torch
    if GPU:
        torch.cuda.synchronize()


def step_intervals(path: str) -> list[float]:
    with open(path) as f:
        ends = [json.loads(line)["t"] for line in f if line.strip()]
    return [b - a for a, b in zip(ends, ends[1:])]


def summary(name: str, gaps: list[float]) -> dict:
    return {"system": name, "steps": len(gaps), "median_step_ms": round(1e3 * statistics.median(gaps), 4),
            "mean_step_ms": round(1e3 * statistics.fmean(gaps), 4),
            "p10_ms": round(1e3 * sorted(gaps)[len(gaps) // 10], 4), "p90_ms": round(1e3 * sorted(gaps)[9 * len(gaps) // 10], 4)}


def profiled(name: str, out: str, fn) -> None:
    """fn() under cProfile, then under torch.profiler; both reports written to `out`."""
    from torch.profiler import ProfilerActivity, profile
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    s = io.StringIO()
    ps = pstats.Stats(pr, stream=s)
    ps.sort_stats("tottime").print_stats(45)
    ps.sort_stats("cumulative").print_stats(60)
    with open(os.path.join(out, f"cprofile-{name}.txt"), "w") as f:
        f.write(s.getvalue())
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if GPU else [])) as prof:
        fn()
        _sync()
    with open(os.path.join(out, f"torchprof-{name}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70))
        if GPU:
            f.write("\n\n")
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def run_plain(hidden: int, steps: int, profile_steps: int, log: str, out: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import default_collate

    from benchmarks.overhead import GLOBAL_BATCH, SEED, timed_optimizer
    from elastic import workload
    from elastic.data.order import GlobalOrder
    from elastic.workload import build_mlp

    torch.set_num_threads(1)  # as elastic's worker at scaling.cpus_per_worker 1
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    torch.manual_seed(SEED)
    if GPU:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
        model = DDP(build_mlp(hidden).to(device), device_ids=[0], gradient_as_bucket_view=True)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        model = DDP(build_mlp(hidden), gradient_as_bucket_view=True)
    os.environ["ELASTIC_BENCH_STEP_LOG"] = log
    optimizer = timed_optimizer(model.parameters())
    dataset = workload.build_dataset()
    order = GlobalOrder(len(dataset), SEED)
    step = iter(itertools.count())

    def train(n: int) -> None:
        for _ in range(n):
            idx = order.rank_indices(next(step), GLOBAL_BATCH, 1, 0)
            batch = [t.to(device, non_blocking=True) for t in default_collate([dataset[j] for j in idx])]
            optimizer.zero_grad(set_to_none=True)
            workload.loss_fn(model, batch).backward()
            optimizer.step()

    train(WARMUP)
    open(log, "w").close()
    train(steps)
    rec = summary("plain", step_intervals(log))
    profiled("plain", out, lambda: train(profile_steps))
    dist.destroy_process_group()
    return rec


def run_elastic(hidden: int, steps: int, profile_steps: int, log: str, out: str) -> dict:
    from benchmarks.overhead import HIDDEN_ENV, elastic_job
    from benchmarks.probes.no_ray import prepare, start_rank

    os.environ[HIDDEN_ENV] = str(hidden)  # the job's model (workload.build_model) reads its width here
    work = tempfile.mkdtemp(prefix="gpu-step-profile-")
    job = elastic_job(hidden, 10 ** 6, "file://" + work, num_workers=1, gpu=GPU)
    job["checkpoint"]["every_steps"] = 10 ** 6
    job_json, root, store = prepare(job)
    os.environ["ELASTIC_BENCH_STEP_LOG"] = log
    w = start_rank(job_json, root, store.address()[1])
    w.restore([])

    def train(n: int) -> None:
        target = w.step + n
        res = w.run(target, [])
        if res.status != "done" or w.step != target:
            raise RuntimeError(f"elastic's run ended {res}")

    train(WARMUP)
    open(log, "w").close()
    train(steps)
    gaps = step_intervals(log)[:-1]  # the last step of a run() saves a checkpoint
    rec = summary("elastic", gaps)
    records = [r for r in w.runner.take()[0]][-steps:]
    rec["elastic_step_s_ms"] = round(1e3 * statistics.median(r.step_s for r in records), 4)
    rec["elastic_compute_s_ms"] = round(1e3 * statistics.median(r.compute_s for r in records), 4)
    profiled("elastic", out, lambda: train(profile_steps))
    return rec


def step_main(args) -> int:
    import torch
    out = args.out or tempfile.mkdtemp(prefix="gpu-step-profile-out-")
    os.makedirs(out, exist_ok=True)
    print(json.dumps({"gpu": torch.cuda.get_device_name(0) if GPU else None, "torch": torch.__version__,
                      "hidden": args.hidden, "out": out}), flush=True)
    system = args.system
    log = os.path.join(out, f"steps-{system}.log")
    fn = run_plain if system == "plain" else run_elastic
    rec = fn(args.hidden, args.steps, args.profile_steps, log, out)
    print(json.dumps(rec), flush=True)
    return 0


# ---------------------------------------------------------------- memory
def memory_one(spec: dict) -> dict:
    """One FSDP run of examples/gpt.py at world size 1 in this (fresh) process."""
    import torch

    from benchmarks.probes.no_ray import prepare, start_rank
    work = tempfile.mkdtemp(prefix="gpu-mem-")
    train = {"model": "examples.gpt:build_model", "dataset": "examples.gpt:build_dataset",
             "loss": "examples.gpt:loss_fn", "global_batch_size": spec["batch"], "strategy": "fsdp",
             "fsdp": {"offload": spec["offload"]}, "meta_init": spec["meta_init"],
             "activation_checkpointing": ["Block"] if spec["ac"] else None, "precision": spec["precision"]}
    job = {"run": {"name": f"mem-{uuid.uuid4().hex[:6]}", "num_steps": spec["steps"], "seed": 0},
           "scaling": {"num_workers": 1, "use_gpu": GPU},
           "checkpoint": {"storage_uri": "file://" + work, "every_steps": 10 ** 6, "memory_every_steps": 0},
           "train": train}
    job_json, root, store = prepare(job)
    w = start_rank(job_json, root, store.address()[1])
    t0 = time.time()
    w.restore([])
    build_s = time.time() - t0
    gpu = torch.cuda if GPU else None
    build_peak = gpu.max_memory_allocated() if gpu else 0
    build_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if gpu:
        gpu.reset_peak_memory_stats()
    t0 = time.time()
    # The steps alone, not run(): its last step would write a checkpoint of the whole state to disk.
    w.copies.start(w.generation, None)
    micro = w.runner.data.micro = w.runner.data.micro_batch()
    for _ in range(spec["steps"]):
        w.runner.train_step(micro)
    _sync()
    steps_s = time.time() - t0
    n_params = sum(p.numel() for p in w.model.parameters())
    return {**spec, "step": w.step, "params_m": round(n_params / 1e6, 1),
            "gpu_build_peak_mib": round(build_peak / 2 ** 20),
            "gpu_train_peak_mib": round(gpu.max_memory_allocated() / 2 ** 20) if gpu else None,
            "gpu_train_reserved_mib": round(gpu.max_memory_reserved() / 2 ** 20) if gpu else None,
            "host_build_peak_rss_mib": round(build_rss),
            "host_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "build_s": round(build_s, 1), "train_s": round(steps_s, 1), "loss": w._progress.get("loss")}


def memory_main(args) -> int:
    from benchmarks.pipeline import gpt_env
    env = {**os.environ, **gpt_env(args.memory), "PYTHONUNBUFFERED": "1"}
    ok = True
    for offload, meta, ac in itertools.product((False, True), (False, True), (False, True)):
        if offload and meta:
            continue  # refused by the config (train.fsdp.offload with train.meta_init is not built)
        spec = {"gpt": args.memory, "batch": args.batch, "steps": args.memory_steps, "offload": offload,
                "meta_init": meta, "ac": ac, "precision": args.precision}
        p = subprocess.run([sys.executable, "-m", "benchmarks.probes.gpu_step_profile", "--one", json.dumps(spec),
                            *(["--cpu"] if args.cpu else [])],
                           env=env, capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode or not lines:
            ok = False
            print(json.dumps({**spec, "error": (p.stderr or p.stdout)[-1500:]}), flush=True)
        else:
            print(lines[-1], flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.gpu_step_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("plain", "elastic"), default="elastic")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile-steps", type=int, default=50)
    p.add_argument("--out", default=None)
    p.add_argument("--memory", default=None, metavar="LAYERS,DIM,CONTEXT")
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU: check the script without a GPU")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global GPU
    GPU = not args.cpu
    if args.one:
        print(json.dumps(memory_one(json.loads(args.one))), flush=True)
        return 0
    return memory_main(args) if args.memory else step_main(args)


if __name__ == "__main__":
    sys.exit(main())
