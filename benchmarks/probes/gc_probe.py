"""How long Python's cyclic garbage collector holds elastic's ranks during training.

elastic DDP, 2 ranks on the 2 one-CPU worker nodes of a local cluster, the overhead benchmark's
1.3 M MLP, global batch 96, a checkpoint every 50 steps to local disk. Each worker logs every full
(generation 2) collection and every collection of any generation that took over 5 ms, from
`gc.callbacks`, registered by the model factory below. Both settings run on one cluster,
alternated: as shipped (the worker freezes what its set-up left alive,
elastic/runtime/worker.py), and unfrozen, where the factory calls `gc.unfreeze()` first (every
object back in the collector's generations, as before the freeze). Pairs alternate which setting
runs first.
Usage: python benchmarks/probes/gc_probe.py [STEPS] [PAIRS]   (default 600 steps, 2 pairs)"""
import gc
import json
import os
import statistics
import sys
import tempfile
import time

LOG_ENV, UNFREEZE_ENV = "GC_PROBE_LOG", "GC_PROBE_UNFREEZE"


def build_model():
    """The benchmark's model, plus the collection log (runs in the worker, at each build)."""
    from elastic.workload import build_model as build
    if os.environ.get(UNFREEZE_ENV) == "1" and os.path.exists(os.environ[UNFREEZE_ENV + "_FLAG"]):
        gc.unfreeze()
    if not any(getattr(cb, "gc_probe", False) for cb in gc.callbacks):
        log = open(os.path.join(os.environ[LOG_ENV], f"gc-{os.getpid()}.jsonl"), "a")
        started = {}

        def on_gc(phase, info):
            if phase == "start":
                started["t"] = time.perf_counter()
                return
            ms = (time.perf_counter() - started["t"]) * 1e3
            if info["generation"] == 2 or ms > 5:
                log.write(json.dumps({"gen": info["generation"], "ms": ms, "t": time.time()}) + "\n")
                log.flush()
        on_gc.gc_probe = True
        gc.callbacks.append(on_gc)
    return build()


def main() -> None:
    from alternating import alternating_runs

    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 600
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    work = tempfile.mkdtemp(prefix="gc-probe-")
    flag = os.path.join(work, "unfreeze")

    def prepare(job: dict, frozen: bool) -> None:  # pairs alternate which setting runs first
        if not frozen:
            open(flag, "w").close()
        elif os.path.exists(flag):
            os.remove(flag)
        for f in os.listdir(work):
            if f.startswith("gc-"):
                os.remove(os.path.join(work, f))
        job["train"]["model"] = "gc_probe:build_model"

    env = {LOG_ENV: work, UNFREEZE_ENV: "1", UNFREEZE_ENV + "_FLAG": flag}
    for frozen, ends in alternating_runs(work, 1024, steps, pairs, env, prepare):
        dts = [b - a for a, b in zip(ends[5:], ends[6:])]
        events = [json.loads(line) for f in os.listdir(work) if f.startswith("gc-")
                  for line in open(os.path.join(work, f))]
        t0, t1 = ends[5], ends[-1]
        during = [e for e in events if t0 <= e["t"] <= t1]
        full = [e["ms"] for e in during if e["gen"] == 2]
        slow = [e["ms"] for e in during if e["ms"] > 5]
        print(f"{'frozen  ' if frozen else 'unfrozen'}: {len(dts)} steps, median {statistics.median(dts) * 1e3:.1f} ms, "
              f"mean {statistics.mean(dts) * 1e3:.2f} ms; both ranks: {len(full)} full collections "
              f"({sum(full):.0f} ms in all, longest {max(full, default=0):.0f} ms), "
              f"{len(slow)} collections over 5 ms", flush=True)


if __name__ == "__main__":
    main()
