"""What a tensor-parallel step runs, counted rather than timed: elastic's step against the plain
torchtitan-style script's (`benchmarks.plain_tp`) on the same layout, each rank under
torch.profiler. Counts do not depend on how busy the machine is; times here do. Global rank 0's
operator counts per step are the difference between a run of 2N and one of N steps (so set-up
and warm-up cancel), printed side by side where they differ. `--time R`: instead, R rounds of
each system (alternating) timed by the same optimizer post-step clock, steady-state steps/s.

    python -m benchmarks.probes.tp_op_counts --layout ddp:dp2xtp2+sp [--steps 6] [--gpt 4,256,64]
    python -m benchmarks.probes.tp_op_counts --layout ddp:dp2xtp2+sp --time 3 --steps 40

No Ray: elastic's ranks are real Workers in spawned processes (join, restore, run), the plain
script's are torchrun's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.parallel import elastic_job, parse_layout
from benchmarks.pipeline import gpt_env


def _counts(prof) -> dict[str, int]:
    return {e.key: e.count for e in prof.key_averages()}


def _elastic_rank(rank, world, port, job_json, root, steps, out, env):
    os.environ.update(env)
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.probes.no_ray import start_rank
    w = start_rank(job_json, root, port, rank, world)
    w.restore([])
    if out is None:  # timed (the step clock is the job's optimizer)
        w.run(steps, [])
        w.leave()
        return
    w.run(2, [])  # warm-up: the first steps build buckets and caches
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        w.run(2 + steps, [])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(_counts(prof), f)
    w.leave()


def run_elastic(layout: str, steps: int, env: dict[str, str], timed: bool = False) -> dict[str, int]:
    import torch.multiprocessing as mp

    from benchmarks.probes.no_ray import prepare
    strategy, dp, tp, sp = parse_layout(layout)
    work = tempfile.mkdtemp(prefix="tp-ops-")
    job = elastic_job(strategy, dp, tp, "file://" + work, sp)
    job["run"]["num_steps"] = 1000
    job["checkpoint"]["every_steps"] = 1000
    if not timed:
        job["train"]["optimizer"] = "examples.gpt:build_optimizer"
    job_json, root, store = prepare(job)
    out = None if timed else os.path.join(work, "counts.json")
    mp.start_processes(_elastic_rank, args=(dp * tp, store.address()[1], job_json, root, steps, out, env),
                       nprocs=dp * tp, start_method="spawn", join=True)
    if timed:
        return {}
    with open(out) as f:
        return json.load(f)


def run_plain(layout: str, steps: int, env: dict[str, str], timed: bool = False) -> dict[str, int]:
    strategy, dp, tp, sp = parse_layout(layout)
    out = tempfile.mktemp(prefix="tp-ops-plain-", suffix=".json")
    args = ["--strategy", strategy, "--tp", str(tp), "--steps", str(steps), *(["--sequence-parallel"] if sp else [])]
    head = ["-m", "benchmarks.plain_tp"] if timed else ["-m", "benchmarks.probes.tp_op_counts", "--plain-rank", out, "--"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp * tp}", *head, *args]
    subprocess.run(cmd, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True)
    if timed:
        return {}
    with open(out) as f:
        return json.load(f)


def plain_rank(out: str, argv: list[str]) -> int:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import plain_tp
    real = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # read the rank before the group is gone
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        plain_tp.main(argv)
    rank = dist.get_rank()
    dist.destroy_process_group = real
    real()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(_counts(prof), f)
    return 0


def per_step(run, layout: str, steps: int, env: dict[str, str]) -> dict[str, float]:
    a, b = run(layout, steps, env), run(layout, 2 * steps, env)
    return {k: (b.get(k, 0) - a.get(k, 0)) / steps for k in set(a) | set(b)}


def time_main(args, env: dict[str, str]) -> int:
    import statistics

    from benchmarks.plain_pipeline import STEP_LOG_ENV, step_rate
    rates: dict[str, list[float]] = {"elastic": [], "plain": []}
    for r in range(args.time):
        for name in (["elastic", "plain"] if r % 2 == 0 else ["plain", "elastic"]):
            log = tempfile.mktemp(prefix=f"tp-time-{name}-")
            (run_elastic if name == "elastic" else run_plain)(args.layout, args.steps, {**env, STEP_LOG_ENV: log}, True)
            with open(log) as f:
                times = [json.loads(line)["t"] for line in f if line.strip()]
            rates[name].append(step_rate(times, min(10, args.steps // 4))["steps_per_s"])
            print(json.dumps({"layout": args.layout, "system": name, "round": r, "steps_per_s": round(rates[name][-1], 3)}),
                  flush=True)
    ratios = [e / p for e, p in zip(rates["elastic"], rates["plain"])]
    print(json.dumps({"layout": args.layout, "elastic_over_plain_median": round(statistics.median(ratios), 3),
                      "per_round": [round(x, 3) for x in ratios]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--plain-rank":
        return plain_rank(argv[1], argv[3:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.tp_op_counts", description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="ddp:dp2xtp2+sp")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--gpt", default="4,256,64")
    p.add_argument("--time", type=int, default=0, metavar="ROUNDS")
    args = p.parse_args(argv)
    env = {**gpt_env(args.gpt), "PYTHONPATH": os.getcwd()}
    os.environ.update(env)
    if args.time:
        return time_main(args, env)
    e = per_step(run_elastic, args.layout, args.steps, env)
    q = per_step(run_plain, args.layout, args.steps, env)
    print(f"{args.layout}, per step on global rank 0 (elastic - plain where they differ):")
    rows = sorted(((e.get(k, 0) - q.get(k, 0), k) for k in set(e) | set(q)), key=lambda r: -abs(r[0]))
    for d, k in rows:
        if abs(d) >= 0.5:
            print(f"  {d:+8.1f}  {k[:70]:70s} elastic {e.get(k, 0):7.1f}  plain {q.get(k, 0):7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
