"""A worker's build before it joins a group, with the model's init (a spare: it times its compute
next) and without it (a worker started for a recovery or a resize: a state is loaded over it
next, `state.build(fill=False)`). One Worker in this process, no group, no Ray, one compute
thread, the benchmarks' MLP at HIDDEN width (default 9354: 90.0 M parameters). One untimed build
first (one-time imports and seeding), then ROUNDS of each, alternating; medians.

    python -m benchmarks.probes.warm_build [HIDDEN]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

ROUNDS = 3


def bench_worker(hidden: int, name: str, num_workers: int):
    """One Worker in this process (not joined) on the benchmarks' MLP at `hidden` width, one
    compute thread, checkpoints in a fresh folder: (the worker, its storage URI, its root)."""
    os.environ["ELASTIC_BENCH_HIDDEN"] = str(hidden)
    import torch

    from elastic.checkpoint.layout import checkpoints_root
    from elastic.config import JobConfig
    from elastic.runtime.worker import Worker

    torch.set_num_threads(1)
    uri = f"file://{tempfile.mkdtemp(prefix=f'{name}-')}"
    job = JobConfig.model_validate({
        "run": {"name": name, "num_steps": 1, "seed": 1}, "scaling": {"num_workers": num_workers},
        "checkpoint": {"storage_uri": uri},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": 96}})
    root = checkpoints_root(uri, name)
    return Worker(job.model_dump_json(), root), uri, root


def main(hidden: int = 9354) -> dict:
    from elastic.runtime import state

    w, _, _ = bench_worker(hidden, "warm", 3)
    state.build(w, fill=False)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(ROUNDS):
        for fill in (True, False):
            w.model = w.optimizer = None
            t0 = time.perf_counter()
            state.build(w, fill=fill)
            times[fill].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in w.model.parameters())
    return {"params": params, "with_init_s": [round(x, 3) for x in times[True]],
            "without_init_s": [round(x, 3) for x in times[False]],
            "median_with_init_s": round(statistics.median(times[True]), 3),
            "median_without_init_s": round(statistics.median(times[False]), 3)}


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:2]))))
