"""A replica's state copied to one replacement, the two ways a restore from a peer has done it, on
gloo over loopback: `broadcast` (the old way: one flat buffer per dtype, broadcast from one survivor
to every rank) and `p2p` (elastic/parallel/peer_copy.py: the replacement alone receives, each
survivor sends half, straight into its tensors). Three ranks, one process each, the state split
into tensors the size of the 90 M MLP's (3 x 90 M float32 values: parameters and AdamW's two
moments, 1.08 GB). Each method runs in fresh processes (so the receiver's peak resident memory is
its own), alternating, REPS times.

    python -m benchmarks.probes.peer_copy [REPS] [STATE_MB]
"""
from __future__ import annotations

import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, RECEIVER = 3, 2


def _tensors(total_mb: float, fill: float) -> list[torch.Tensor]:
    """Parameters and two moments of an MLP of 8 square layers, `total_mb` in all."""
    per = int(total_mb * 1e6 / 4 / 3 / 8)
    side = int(per ** 0.5)
    return [torch.full((side, side), fill) for _ in range(3 * 8)] + [torch.full((side,), fill) for _ in range(3 * 8)]


def _rank(rank: int, port: int, method: str, total_mb: float, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    from elastic.parallel.broadcast import broadcast_tensors
    from elastic.parallel.peer_copy import copy_state
    group = dist.new_group(list(range(WORLD)))
    state = _tensors(total_mb, 1.0 if rank != RECEIVER else 0.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.barrier(group)
    t0 = time.perf_counter()
    if method == "broadcast":
        broadcast_tensors(state, 0, group)
    else:
        copy_state(state, rank != RECEIVER, group)
    took = time.perf_counter() - t0
    ok = all(bool((t == 1.0).all()) for t in state)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    q.put((rank, took, peak - before, ok))
    dist.destroy_process_group()


def once(method: str, total_mb: float, port: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, method, total_mb, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = {}
    for _ in range(WORLD):
        r, took, grew, ok = q.get(timeout=600)
        out[r] = (took, grew, ok)
    for p in procs:
        p.join(timeout=60)
    assert all(ok for _, _, ok in out.values()), f"{method}: a rank did not end with the source's values"
    return {"s": max(t for t, _, _ in out.values()), "receiver_peak_growth_mb": out[RECEIVER][1],
            "source_peak_growth_mb": out[0][1]}


def main(reps: int = 3, total_mb: float = 1080.0) -> None:
    from tests.ray_fixtures import free_port
    runs: dict[str, list[dict]] = {"broadcast": [], "p2p": []}
    for _ in range(reps):
        for method in runs:
            runs[method].append(once(method, total_mb, free_port()))
    print(f"{total_mb:.0f} MB of state, {WORLD} ranks (2 hold it, 1 receives), gloo over loopback, {reps} reps; medians:")
    for method, rs in runs.items():
        s = statistics.median(r["s"] for r in rs)
        print(f"  {method:9s} {s:6.2f} s  {total_mb / 1e3 / s:5.2f} GB/s into the receiver  "
              f"receiver's peak RSS grew {statistics.median(r['receiver_peak_growth_mb'] for r in rs):6.0f} MB, "
              f"a source's {statistics.median(r['source_peak_growth_mb'] for r in rs):6.0f} MB  "
              f"(each: {[round(r['s'], 2) for r in rs]})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, float(sys.argv[2]) if len(sys.argv) > 2 else 1080.0)
