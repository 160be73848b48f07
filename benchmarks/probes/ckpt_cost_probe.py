"""What a small model's checkpoint costs training, and the persist thread's CPU time per phase.

elastic DDP, 2 ranks on the 2 one-CPU worker nodes of a local cluster, the overhead benchmark's
1.3 M MLP, global batch 96, checkpoints to local disk. Runs alternate between a checkpoint every
50 steps and none (pairs alternate which goes first), on one cluster. Each worker logs, from
wrappers the model factory below installs, the thread CPU time (`time.thread_time`) and wall
time of the persist (`AsyncCheckpointer._persist`) and of its phases: the agreement, the DCP save
(`save_shards`), rank 0's commit and retention. Steps are timed by the overhead benchmark's
optimizer hook on rank 0.
Per run it prints the median step, and the time the steps from 51 to the end took beyond that
median ("extra"): the checkpoints' cost, plus what the steps' spread adds in a run without them.
Usage: python benchmarks/probes/ckpt_cost_probe.py [STEPS] [PAIRS]   (default 300 steps, 2 pairs)"""
import json
import os
import statistics
import sys
import tempfile
import time

LOG_ENV = "CKPT_COST_PROBE_LOG"
PHASES = ("_persist", "_agree", "save_shards", "_commit_with_retries", "apply_retention")


def build_model():
    """The benchmark's model; first installs the timing wrappers (runs in the worker)."""
    import elastic.checkpoint.persister as ck
    from elastic.workload import build_model as build
    if not getattr(ck, "_cost_probe", False):
        ck._cost_probe = True
        log = open(os.path.join(os.environ[LOG_ENV], f"ck-{os.getpid()}.jsonl"), "a")
        for name in PHASES:
            owner = ck.AsyncCheckpointer if hasattr(ck.AsyncCheckpointer, name) else ck
            setattr(owner, name, _timed(getattr(owner, name), name, log))
    return build()


def _timed(fn, name, log):
    def timed(*a, **kw):
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            log.write(json.dumps({"fn": name, "cpu": time.thread_time() - cpu, "wall": time.perf_counter() - wall,
                                  "t": time.time()}) + "\n")
            log.flush()
    return timed


def main() -> None:
    from alternating import alternating_runs

    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    work = tempfile.mkdtemp(prefix="ckpt-cost-probe-")

    def prepare(job: dict, on: bool) -> None:
        for f in os.listdir(work):
            if f.startswith("ck-"):
                os.remove(os.path.join(work, f))
        job["train"]["model"] = "ckpt_cost_probe:build_model"
        job["checkpoint"]["every_steps"] = 50 if on else 10 * steps  # off: only the run's final one

    for on, ends in alternating_runs(work, 1024, steps, pairs, {LOG_ENV: work}, prepare):
        dts = [b - a for a, b in zip(ends[5:], ends[6:])]  # dts[k] is step k + 7
        med = statistics.median(dts)
        period = dts[44:]  # steps 51 .. the end: step 50's checkpoint is taken as it ends
        recs = [json.loads(line) for f in os.listdir(work) if f.startswith("ck-")
                for line in open(os.path.join(work, f))]
        during = [r for r in recs if ends[5] <= r["t"] <= ends[-1]]  # not the run's final checkpoint
        per = {name: [r for r in during if r["fn"] == name] for name in PHASES}
        phases = ", ".join(f"{name.strip('_')} {statistics.median(r['cpu'] for r in v) * 1e3:.1f}/"
                           f"{statistics.median(r['wall'] for r in v) * 1e3:.1f} ms (n={len(v)})"
                           for name, v in per.items() if v)
        after = [round(dts[s - 7] * 1e3) for s in range(51, steps, 50)]  # the steps after steps 50, 100, ...
        print(f"{'every 50' if on else 'off     '}: median step {med * 1e3:.1f} ms; steps 51-{steps}: "
              f"{sum(period):.2f} s, extra {sum(period) - med * len(period):.3f} s; steps 51, 101, ...: "
              f"{after} ms; per phase, CPU/wall medians over both ranks: {phases or '-'}", flush=True)


if __name__ == "__main__":
    main()
