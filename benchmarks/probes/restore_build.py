"""A restore's build on one FSDP rank, with the optimizer state made by DCP's own init (one
optimizer step on zero gradients) and by `prime_optimizer_state` (elastic/parallel/optim_state.py:
zeros, structure from a step on meta-device stand-ins): three real Workers on spawned gloo ranks without Ray, the
benchmarks' MLP at `--hidden` width, FSDP over 3, AdamW. Each round does what a re-shard's
`build` phase does (restore.from_shards): a fresh build with fill=False, then the state dict.
The two ways alternate, 6 timed rounds each after one of each; medians per rank.

    python -m benchmarks.probes.restore_build [HIDDEN]   (default 9354: 90.0 M parameters)
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

ROUNDS = 6


def rank_main(rank: int, world: int, port: int, job: dict, root: str, hidden: int, q) -> None:
    os.environ["ELASTIC_BENCH_HIDDEN"] = str(hidden)
    from elastic.parallel import base
    from elastic.runtime import state
    from elastic.runtime.actor import import_worker
    Worker = import_worker()
    w = Worker(json.dumps(job), root)
    w.join("127.0.0.1", port, rank, world, generation=1, pp=1)
    w.restore([])
    primed = base.prime_optimizer_state
    times: dict[str, list[float]] = {"dcp": [], "primed": []}
    for i in range(2 * (ROUNDS + 1)):
        way = "primed" if i % 2 else "dcp"
        base.prime_optimizer_state = primed if way == "primed" else (lambda opt: False)
        t0 = time.monotonic()
        w.forget_old_meshes()
        state.build(w, fill=False)
        state.state_dict(w)
        if i >= 2:  # the first of each way warms allocator and caches
            times[way].append(time.monotonic() - t0)
    base.prime_optimizer_state = primed
    q.put((rank, {k: round(statistics.median(v), 3) for k, v in times.items()}))


def main() -> None:
    from tests.spawn_ranks import rendezvous_port
    hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 9354
    root = tempfile.mkdtemp()
    job = {"run": {"name": "probe", "num_steps": 5, "seed": 0}, "scaling": {"num_workers": 3},
           "checkpoint": {"storage_uri": "file://" + root, "every_steps": 100},
           "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                     "loss": "elastic.workload:loss_fn", "optimizer": "elastic.workload:build_optimizer",
                     "global_batch_size": 96, "strategy": "fsdp"}}
    port = rendezvous_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, 3, port, job, root, hidden, q)) for r in range(3)]
    for p in procs:
        p.start()
    out = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    from benchmarks.overhead import num_params
    params = num_params(hidden)
    print(f"hidden {hidden} ({params / 1e6:.1f} M parameters), FSDP over 3, median of {ROUNDS} builds + state dict:")
    for r in sorted(out):
        d = out[r]
        print(f"  rank {r}: DCP's init {d['dcp']:.3f} s, primed {d['primed']:.3f} s ({d['primed'] / d['dcp']:.2f}x)")


if __name__ == "__main__":
    main()
