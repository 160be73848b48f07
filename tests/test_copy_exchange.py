"""memory_sync's copies rank to rank (elastic/runtime/copy_exchange.py), on spawned gloo ranks: a
ring of buddies gets every part whole, bit for bit, whatever its dtypes and shapes, the next one
into the last one's tensors; a silent buddy ends the wait once the group is aborted, not at the
collective timeout."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.spawn_ranks import rendezvous_port

pytestmark = pytest.mark.timeout(120)


def _part(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {"part": rank, "world": 3, "step": 7,
            "sharded": {("net", "0", "weight"): torch.randn(5, 3, generator=g),
                        ("opt", "exp_avg"): torch.randn(4, generator=g).to(torch.bfloat16),
                        ("empty",): torch.empty(0, 3)},
            "other": {("opt", "step"): torch.tensor(7.0), ("lr",): 0.1, ("names",): ["a", "b"]}}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _ring(rank: int, world: int, port: int, q) -> None:
    from elastic.runtime.copy_exchange import exchange_parts
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    buddy, source = (rank + 1) % world, (rank - 1) % world  # each rank keeps its predecessor's part
    got = exchange_parts(_part(rank), buddy, [source], None)
    first = got[source]["sharded"][("net", "0", "weight")]
    whole = _same(got[source], _part(source))  # before the next exchange overwrites it
    # The next exchange lands in the first one's tensors (reused), with the new values.
    newer = {**_part(rank + 10), "part": rank}
    again = exchange_parts(newer, buddy, [source], None, reuse={source: got[source]})
    second = again[source]["sharded"][("net", "0", "weight")]
    q.put((rank, sorted(got), whole and _same(again[source], {**_part(source + 10), "part": source}),
           second.data_ptr() == first.data_ptr()))
    dist.destroy_process_group()


def _silent_buddy(rank: int, world: int, port: int, q) -> None:
    from elastic.runtime.collectives import GroupAborted
    from elastic.runtime.copy_exchange import exchange_parts
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    if rank == 1:  # never takes part: rank 0 waits for its part until its group is aborted
        time.sleep(3)
        _put_and_exit(q, (rank, "silent", None))
    t0 = time.monotonic()
    try:
        exchange_parts(_part(0), 1, [1], None, aborted=lambda: time.monotonic() - t0 > 0.3, timeout_s=60)
        _put_and_exit(q, (rank, "returned", None))
    except GroupAborted as e:
        _put_and_exit(q, (rank, "aborted", round(time.monotonic() - t0, 2), str(e)))


def _put_and_exit(q, item) -> None:
    """Report, then leave at once: the helper thread is still blocked in gloo (a normal exit
    would wait for the process group's teardown)."""
    q.put(item)
    q.close()
    q.join_thread()
    os._exit(0)


def _spawn(fn, world: int) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = rendezvous_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = [q.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(30)
    return sorted(out, key=lambda o: o[0])


def test_a_ring_of_buddies_gets_every_part_whole():
    out = _spawn(_ring, 3)
    assert out == [(0, [2], True, True), (1, [0], True, True), (2, [1], True, True)]


def test_a_silent_buddy_ends_the_wait_when_the_group_is_aborted():
    out = _spawn(_silent_buddy, 2)
    rank0 = out[0]
    assert rank0[1] == "aborted" and rank0[2] < 5, rank0  # not the 60 s timeout
    assert "aborted" in rank0[3], rank0
