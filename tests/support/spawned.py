"""Ranks of a gloo group as spawned processes in the test's own machine (no Ray): each runs
`target(rank, world, port, *args, queue)` and puts one result whose first element is its rank."""
from __future__ import annotations

import socket

import torch


def run_spawned(target, world: int, *args, timeout_s: float = 90.0) -> list:
    """The ranks' results, sorted by rank. `port`: a free one on 127.0.0.1 for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((q.get(timeout=timeout_s) for _ in procs), key=lambda o: o[0])
    for p in procs:
        p.join(30)
    return results
