"""The bounded-memory broadcast (elastic/parallel/broadcast.py): its plan, and real gloo groups of
spawned processes where rank 1's tensors are broadcast into every rank's."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.parallel.broadcast import Batch, Segment, plan_broadcast
from tests.ray_fixtures import free_port

KB = 2 ** 10


def test_large_tensors_on_the_device_go_in_place_and_the_rest_packed_per_dtype_within_the_chunk():
    sizes = [(4 * KB, 4, "float32", True),  # 16 KiB on the device: in place
             (10, 4, "float32", True),  # small: packed
             (3 * KB, 4, "float32", False),  # 12 KiB on the host: cut across buffers of 8 KiB
             (5, 8, "int64", True),
             (0, 4, "float32", True)]  # empty: nothing to send
    plan = plan_broadcast(sizes, chunk_bytes=8 * KB)
    assert plan[0] == Batch(True, (Segment(0, 0, 4 * KB),))
    packed = plan[1:]
    assert packed == [Batch(False, (Segment(1, 0, 10), Segment(2, 0, 2 * KB - 10))),
                      Batch(False, (Segment(2, 2 * KB - 10, 3 * KB),)),
                      Batch(False, (Segment(3, 0, 5),))]
    for b in packed:  # never over the chunk
        assert sum(s.hi - s.lo for s in b.segments) * sizes[b.segments[0].index][1] <= 8 * KB
    # Every element of every tensor is in exactly one batch.
    for i, (n, *_) in enumerate(sizes):
        got = sorted((s.lo, s.hi) for b in plan for s in b.segments if s.index == i)
        assert sum(hi - lo for lo, hi in got) == n and all(a[1] == b[0] for a, b in zip(got, got[1:]))


def _state(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(40 * KB, generator=g),  # 160 KiB: in place at a 64 KiB chunk
            torch.randn(30 * KB, generator=g),  # 120 KiB: in place
            torch.randn(64, 48, generator=g).t(),  # not contiguous: packed, copied back
            torch.randn(7, generator=g).double(),
            torch.tensor(seed, dtype=torch.int64),
            torch.randn(0, generator=g),
            torch.randn(40 * KB, generator=g)[::2]]  # strided, 80 KiB: cut across two buffers


def _rank(rank: int, world: int, port: int, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from elastic.parallel.broadcast import broadcast_tensors
    try:
        group = dist.new_group(list(range(world)))
        mine = _state(100 + rank)
        broadcast_tensors(mine, 1, group, chunk_bytes=64 * KB)
        want = _state(101)
        q.put((rank, [torch.equal(a, b) for a, b in zip(mine, want)], mine[2].is_contiguous()))
    finally:
        dist.destroy_process_group()


def test_every_rank_ends_with_the_source_s_values_in_its_own_tensors():
    world = 3
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict((r, rest) for r, *rest in (q.get(timeout=120) for _ in range(world)))
    for p in procs:
        p.join(timeout=60)
    for r, (equal, contiguous) in out.items():
        assert all(equal), (r, equal)
        assert not contiguous  # the strided tensor was filled in place, not replaced
