"""`python -m benchmarks compression`: train.grad_compression's modes against none, on elastic's
DataParallel strategy alone (no Ray, no checkpoints): bytes each rank hands its collectives per
step, the ring estimate of what crosses its link, steps/s, and the loss curve beside them.

Ranks are processes on this machine in one gloo group (`--workers`, default 2), training the
common workload's MLP (`--hidden` sets its width: 1024 is 1.3 M parameters, 7000 about 50 M,
9900 about 100 M) with SGD on the same samples in every mode. Bytes are counted where the
strategy calls torch.distributed (all_reduce: each rank's tensor; all_gather: its own part), so
they are exact for what the compressors send; the wire estimate is a ring's (all-reduce
2(W-1)/W of the tensor, all-gather (W-1) times the part). On a 2-core machine the time is
compute-bound: a compressor's arithmetic shows, its saving on the link does not (see
docs/grad-compression.md).
"""
from __future__ import annotations

import os
import socket
import statistics
import sys
import time

from benchmarks.output import write_report

MODES = ("none", "bf16", "powersgd", "topk")


def _rank(rank: int, world: int, port: int, mode: str, hidden: int, steps: int, q) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elastic.config import TrainSpec
    from elastic.parallel.ddp import DataParallel
    from elastic.workload import TeacherDataset, build_mlp, loss_fn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    sent = {"payload": 0, "wire": 0.0}
    real_reduce, real_gather = dist.all_reduce, dist.all_gather

    def all_reduce(t, *a, **kw):
        n = t.numel() * t.element_size()
        sent["payload"] += n
        sent["wire"] += 2 * (world - 1) / world * n
        return real_reduce(t, *a, **kw)

    def all_gather(out, t, *a, **kw):
        n = t.numel() * t.element_size()
        sent["payload"] += n
        sent["wire"] += (world - 1) * n
        return real_gather(out, t, *a, **kw)

    dist.all_reduce, dist.all_gather = all_reduce, all_gather
    spec = TrainSpec(model="m:f", dataset="m:f", loss="m:f", global_batch_size=world,
                     grad_compression={"mode": mode, "powersgd_start_step": 10, "powersgd_rank": 4,
                                       "topk_ratio": 0.01})
    strat = DataParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), spec, seed=0)
    torch.manual_seed(0)
    model = build_mlp(hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = TeacherDataset()
    per_rank = 32
    losses, times, payload, wire = [], [], [], []
    for step in range(steps):
        ids = [(step * world * per_rank + rank * per_rank + i) % len(data) for i in range(per_rank)]
        before = dict(sent)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = strat.train_step(model, ids, lambda i: (data.x[i], data.y[i]), loss_fn,
                                micro=per_rank)
        summed = strat.reduce_gradients(model, loss.detach().reshape(1).clone())
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(summed[0]) / world)
        payload.append(sent["payload"] - before["payload"] - 4)  # less the loss's own 4 bytes
        wire.append(sent["wire"] - before["wire"] - 2 * (world - 1) / world * 4)
    q.put((rank, losses, times, payload, wire, sum(p.numel() for p in model.parameters())))
    dist.destroy_process_group()


def run_mode(mode: str, world: int, hidden: int, steps: int) -> dict:
    import torch
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, mode, hidden, steps, q))
             for r in range(world)]
    for p in procs:
        p.start()
    out = sorted((q.get(timeout=3600) for _ in procs), key=lambda o: o[0])
    for p in procs:
        p.join(60)
    _, losses, times, payload, wire, params = out[0]
    warm = max(1, steps // 5)  # PowerSGD compresses from step 10: the steady state after it
    steady = slice(max(warm, 11), None) if steps > 12 else slice(warm, None)
    step_s = statistics.median(max(o[2][i] for o in out) for i in range(steps)[steady])
    return {"bench": "compression", "mode": mode, "world": world, "hidden": hidden,
            "params": params, "steps": steps,
            "payload_bytes_per_step": statistics.median(payload[steady]),
            "wire_bytes_per_step": statistics.median(wire[steady]), "step_s": step_s,
            "steps_per_s": 1 / step_s, "loss": losses, "final_loss": statistics.mean(losses[-5:])}


def main(args) -> int:
    modes = [m for m in (args.systems or ",".join(MODES)).split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"python -m benchmarks compression: --systems: unknown {unknown}; "
              f"choose from {list(MODES)}", file=sys.stderr)
        return 2
    hidden = int(args.hidden or 1024)
    records = []
    for mode in modes:
        rec = run_mode(mode, args.workers, hidden, args.steps)
        records.append(rec)
        print({k: v for k, v in rec.items() if k != "loss"}, flush=True)
    base = next((r for r in records if r["mode"] == "none"), records[0])
    rows = ["| mode | payload MB/step/rank | wire MB/step/rank (ring) | vs none | steps/s | "
            "vs none | loss at 25% | 50% | end |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        curve = r["loss"]
        wire = r["wire_bytes_per_step"]
        rows.append(f"| {r['mode']} | {r['payload_bytes_per_step'] / 1e6:.3f} | {wire / 1e6:.3f} | "
                    f"{_ratio(wire, base['wire_bytes_per_step'])} | {r['steps_per_s']:.2f} | "
                    f"{r['steps_per_s'] / base['steps_per_s']:.2f}x | "
                    f"{curve[len(curve) // 4]:.4f} | {curve[len(curve) // 2]:.4f} | "
                    f"{r['final_loss']:.4f} |")
    notes = (f"{base['params'] / 1e6:.2f} M parameters, {args.workers} gloo ranks on this machine, "
             f"{args.steps} steps, SGD; medians after PowerSGD's start (step 10); "
             f"loss: mean over ranks")
    write_report(args.out, records, "\n".join(rows), notes)
    if args.out:
        _plot(records, os.path.join(args.out, "compression.png"))
    return 0


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}x" if base else "n/a"  # one rank sends nothing over a link


def _plot(records: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the table and the jsonl hold every figure
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in records:
        ax.plot(r["loss"], label=f"{r['mode']} ({r['wire_bytes_per_step'] / 1e6:.2f} MB/step)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
