"""The raw speed of the collective backend for one buffer the size of a run's state: rank 0 sends
it to rank 1 with `dist.send` / `dist.recv`, two processes, one group formed once (a warm-up
message first, so the figure is the link's, not the connection's set-up). What the
`moved_gb_per_s` of a recovery's, resize's or restore's events (docs/events.md) is read against:
`python -m benchmarks recovery` runs it at the start of the same run, for every size.

gloo runs the two ranks on this host's loopback (as the benchmarks' local cluster does); nccl
puts them on two GPUs of this machine (NCCL refuses two ranks on one GPU).

    python -m benchmarks.probes.link_speed [--params 90M | --bytes N] [--backend gloo|nccl]
                                           [--reps 3]

Prints one JSON line: `bytes`, `backend`, `s` (each repetition's seconds on the receiver),
`gb_per_s` (the median's rate, 1 GB = 1e9 bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

STATE_BYTES_PER_PARAM = 12  # fp32 parameter + AdamW's two moments (benchmarks/recovery.py)
PROG = "python -m benchmarks.probes.link_speed"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The probe's arguments, checked: exits 2 naming the flag on a bad one, before any process
    starts."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--params", help="a model size (K, M, G suffixes, e.g. 90M): its state is "
                                       "12 bytes a parameter (default 90M: 1.08 GB)")
    size.add_argument("--bytes", type=int, help="the buffer's size in bytes")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--reps", type=int, default=3,
                   help="repetitions over the same group (median reported)")
    args = p.parse_args(argv)
    if args.bytes is None:
        from benchmarks.recovery import parse_params
        try:
            sizes = parse_params(args.params or "90M")
        except ValueError as e:
            p.error(str(e))
        if len(sizes) != 1:
            p.error(f"--params: expected one size, got {args.params!r}")
        args.bytes = sizes[0] * STATE_BYTES_PER_PARAM
    if args.bytes < 1:
        p.error(f"--bytes: expected a positive size, got {args.bytes}")
    if args.reps < 1:
        p.error(f"--reps: expected at least 1, got {args.reps}")
    if args.backend == "nccl":
        import torch
        if torch.cuda.device_count() < 2:
            p.error(f"--backend nccl: needs 2 GPUs here, this machine has "
                    f"{torch.cuda.device_count()}")
    return args


def _rank(rank: int, port: int, nbytes: int, backend: str, reps: int, q) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.full((nbytes,), 1 if rank == 0 else 0, dtype=torch.uint8, device=device)
    warm = torch.zeros(1, dtype=torch.uint8, device=device)
    (dist.send if rank == 0 else dist.recv)(warm, 1 - rank)
    took = []
    for _ in range(reps):
        buf.fill_(1 if rank == 0 else 0)
        dist.barrier(device_ids=[rank] if backend == "nccl" else None)
        if backend == "nccl":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
        if backend == "nccl":
            torch.cuda.synchronize()
        took.append(time.perf_counter() - t0)
    if rank == 1:
        # Every byte arrived: a rate over a copy that did not happen would be no figure.
        q.put((took, bool((buf == 1).all())))
    dist.destroy_process_group()


def measure(nbytes: int, backend: str = "gloo", reps: int = 3) -> dict:
    """Rank 0 sends one `nbytes` buffer to rank 1, `reps` times, in two fresh processes."""
    import torch.multiprocessing as mp
    from tests.ray_fixtures import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, nbytes, backend, reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        took, whole = q.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if not whole:
        raise RuntimeError(f"{PROG}: the receiver's buffer is not the sender's after the send")
    s = statistics.median(took)
    return {"probe": "link_speed", "backend": backend, "bytes": nbytes, "reps": reps,
            "s": [round(t, 4) for t in took], "gb_per_s": round(nbytes / s / 1e9, 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(json.dumps(measure(args.bytes, args.backend, args.reps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
