"""The point-to-point copy of a replica's state (elastic/parallel/peer_copy.py): the plan, and real
gloo groups of spawned processes where some ranks hold the state and the others receive it."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.parallel.peer_copy import Piece, plan_copy
from tests.ray_fixtures import free_port

MB = 2 ** 20


def test_each_receiver_gets_every_element_once_shared_out_by_bytes():
    sizes = [(10 * MB // 4, 4), (3, 4), (MB, 8), (7, 2)]
    pieces = plan_copy(sizes, holders=[0, 2], receivers=[1, 3], chunk_bytes=MB)
    for r in (1, 3):
        for i, (n, _) in enumerate(sizes):
            got = sorted((p.lo, p.hi) for p in pieces if p.receiver == r and p.index == i)
            assert got[0][0] == 0 and got[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(got, got[1:]))  # contiguous, no overlap
        assert all((p.hi - p.lo) * sizes[p.index][1] <= MB for p in pieces)
        sent = {h: sum((p.hi - p.lo) * sizes[p.index][1] for p in pieces if p.receiver == r and p.sender == h)
                for h in (0, 2)}
        assert abs(sent[0] - sent[2]) <= MB  # each holder sends about half
    assert {p.sender for p in pieces} == {0, 2} and not any(p.sender == p.receiver for p in pieces)


def test_several_receivers_start_on_different_holders():
    pieces = plan_copy([(4, 4)], holders=[0, 1], receivers=[2, 3], chunk_bytes=16)
    assert pieces == [Piece(0, 2, 0, 0, 4), Piece(1, 3, 0, 0, 4)]


def test_nothing_to_send_when_every_rank_holds_it_and_an_error_when_none_does():
    assert plan_copy([(5, 4)], holders=[0, 1], receivers=[]) == []
    with pytest.raises(ValueError, match="no rank holds"):
        plan_copy([(5, 4)], holders=[], receivers=[0])


def _state(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(3 * MB // 4 + 5, generator=g)  # cut into pieces (chunk: 1 MiB in the test)
    strided = torch.randn(64, 48, generator=g).t()  # not contiguous
    return [big, torch.randn(3, generator=g).double(), strided, torch.tensor(seed, dtype=torch.int64),
            torch.randn(0, generator=g)]


def _rank(rank: int, world: int, port: int, holders: list[int], q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import elastic.parallel.peer_copy as pc
    pc.CHUNK_BYTES = MB
    try:
        group = dist.new_group(list(range(world)))
        mine = _state(1 if rank in holders else 100 + rank)
        stats = pc.copy_state(mine, rank in holders, group)
        want = _state(1)
        q.put((rank, all(torch.equal(a, b) for a, b in zip(mine, want)), stats.holders, stats.receivers,
               stats.sent_bytes, stats.received_bytes, mine[2].is_contiguous()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,holders", [(3, [0, 2]), (4, [1]), (3, [0, 1, 2])])
def test_receivers_end_equal_to_the_holders_and_holders_only_send(world, holders):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, holders, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    for _ in range(world):
        rank, *rest = q.get(timeout=120)
        out[rank] = rest
    for p in procs:
        p.join(timeout=60)
    state_bytes = sum(t.numel() * t.element_size() for t in _state(1))
    receivers = [r for r in range(world) if r not in holders]
    for r, (equal, hs, rs, sent, received, contiguous) in out.items():
        assert equal, r
        assert list(hs) == holders and list(rs) == receivers
        assert not contiguous  # a strided tensor stays what it was: filled in place
        if r in holders:
            assert received == 0
        else:
            assert sent == 0 and received == state_bytes
    # Every byte sent was received once: nothing went to a rank that held it already.
    assert sum(v[3] for v in out.values()) == state_bytes * len(receivers)


def test_the_restored_event_reports_the_receivers_rate_and_none_when_nothing_moved():
    from elastic.controller.restoring import transfer_stats
    from elastic.protocol import RestoreResult

    def peer(transfer_s, received, senders=2, receivers=1):
        return RestoreResult(step=5, source="peer rank 0", restore_s=transfer_s + 0.1, phases={"transfer": transfer_s},
                             state_bytes=2_000_000_000, senders=senders, receivers=receivers, received_bytes=received)
    out = {0: peer(1.9, 0), 1: peer(1.8, 0), 2: peer(2.0, 2_000_000_000)}
    assert transfer_stats(out) == {"state_bytes": 2_000_000_000, "senders": 2, "receivers": 1, "transfer_gb_per_s": 1.0}
    held = {r: peer(0.01, 0, senders=3, receivers=0) for r in range(3)}  # a shrink: every rank held it
    assert "transfer_gb_per_s" not in transfer_stats(held)
    bcast = {r: RestoreResult(step=5, source="peer rank 0", restore_s=4.0, phases={"transfer": 4.0 - r},
                              state_bytes=2_000_000_000) for r in range(3)}
    assert transfer_stats(bcast) == {"state_bytes": 2_000_000_000, "transfer_gb_per_s": 0.5}
    assert transfer_stats({0: RestoreResult(step=0, source="init", restore_s=0.1)}) == {}
