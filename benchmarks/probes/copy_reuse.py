"""memory_sync's copy of one step, with and without reusing the memory of the copy it replaces
(e916660), on two spawned gloo ranks without Ray: each rank takes its half of an MLP's state
(parameters and AdamW's two moments, as the overhead benchmark's `--hidden` sizes them) and
exchanges it with the other (elastic/runtime/copy_exchange.py), then a one-number all-reduce, as
memory_sync does every step. "fresh": new memory for every copy and every receive; "reuse": the
oldest of the two kept is written over. The two alternate, 20 timed rounds after 4; medians.

    python -m benchmarks.probes.copy_reuse [HIDDEN ...]   (default: 3072 10000, 10.3 M and 102.7 M)
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def main(rank, n, hidden):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"]="127.0.0.1"; os.environ["MASTER_PORT"]="29541"
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from elastic.parallel.resharding import copy_into
    from elastic.runtime.copy_exchange import exchange_parts
    shapes = [(256, hidden), (hidden,), (hidden, hidden), (hidden,), (hidden, 10), (10,)]
    live = {}
    for k in range(3):
        for i, s in enumerate(shapes):
            t = torch.randn(*s)
            live[(k, i)] = t[: max(1, s[0] // 2)].clone()
    def offer(into):
        old = (into or {}).get("sharded", {})
        return {"step": 0, "sharded": {p: copy_into(v, old.get(p)) for p, v in live.items()}, "other": {}}
    res = {"fresh": [], "reuse": []}
    own = {"fresh": [], "reuse": []}; held = {"fresh": [], "reuse": []}
    for it in range(24):
        mode = "fresh" if it % 2 == 0 else "reuse"
        dist.barrier()
        t0 = time.perf_counter()
        into = own[mode].pop(0) if mode == "reuse" and len(own[mode]) >= 2 else None
        part = offer(into)
        reuse = {1 - rank: held[mode].pop(0)} if mode == "reuse" and len(held[mode]) >= 2 else None
        got = exchange_parts(part, 1 - rank, [1 - rank], None, reuse=reuse)
        dist.all_reduce(torch.zeros(1))
        dt = time.perf_counter() - t0
        own[mode].append(part); held[mode].append(got[1 - rank])
        if mode == "fresh":
            own[mode] = own[mode][-2:]; held[mode] = held[mode][-2:]
        if it >= 4: res[mode].append(dt)
    if rank == 0:
        print(hidden, {m: round(statistics.median(v) * 1e3, 1) for m, v in res.items()}, "ms")
    dist.destroy_process_group()
if __name__ == "__main__":
    for h in [int(a) for a in sys.argv[1:]] or (3072, 10000):
        mp.spawn(main, args=(2, h), nprocs=2)
