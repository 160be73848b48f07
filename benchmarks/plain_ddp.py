"""The no-framework peer of `python -m benchmarks overhead`: the benchmark's MLP trained with plain
`torch.distributed` and `DistributedDataParallel` in processes started by torchrun, on gloo (or, with `--gpu`, NCCL with
one GPU per process), the way torch's DDP tutorial writes it.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.plain_ddp \
        --hidden 3072 --steps 150 --ckpt-every 50 --ckpt-dir /tmp/ckpt

Everything but the framework is the benchmark's (`benchmarks.overhead`): the model
(`build_mlp(hidden)`, built from the same seed on every rank), the data (the common workload's
map-style dataset, `default_collate` of the indices elastic's global sample order gives each
rank), the optimizer (AdamW with the step clock) and the global batch.

Set up to win: DDP's defaults (25 MiB buckets all-reduced during backward) plus
`gradient_as_bucket_view=True` (gradients live in the buckets: no copy back per step), no loss
`.item()`, and the tutorial's checkpoint: rank 0 alone `torch.save`s the model and optimizer
state every `--ckpt-every` steps to local disk, while the other rank goes on (and meets rank 0
again at the next step's all-reduce).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import default_collate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plain_ddp", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, required=True, help="hidden width of the MLP (benchmarks.overhead)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to train")
    p.add_argument("--global-batch", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=0, help="rank 0 torch.saves every this many steps; 0: never")
    p.add_argument("--ckpt-dir", default=None, help="local folder for the checkpoints (needed with --ckpt-every)")
    p.add_argument("--gpu", action="store_true",
                   help="NCCL, the model on cuda:LOCAL_RANK and each batch copied there (as elastic does)")
    args = p.parse_args(argv)
    if args.hidden < 1 or args.steps < 1 or args.global_batch < 1 or args.ckpt_every < 0:
        p.error("--hidden, --steps and --global-batch must be >= 1, --ckpt-every >= 0")
    if args.ckpt_every and not args.ckpt_dir:
        p.error("--ckpt-every needs --ckpt-dir")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastic import workload
    from benchmarks.overhead import timed_optimizer
    from elastic.workload import build_mlp
    from elastic.data.order import GlobalOrder  # the sample order only: a pure function of (len, seed)

    if args.gpu:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)  # torchrun's env:// rendezvous
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of the world size {world}")
    torch.manual_seed(args.seed)
    if args.gpu:
        model = DDP(build_mlp(args.hidden).to(device), device_ids=[device.index], gradient_as_bucket_view=True)
    else:
        model = DDP(build_mlp(args.hidden), gradient_as_bucket_view=True)
    optimizer = timed_optimizer(model.parameters())
    dataset = workload.build_dataset()
    order = GlobalOrder(len(dataset), args.seed)
    for step in range(args.steps):
        idx = order.rank_indices(step, args.global_batch, world, rank)
        batch = default_collate([dataset[j] for j in idx])
        if args.gpu:  # from pageable memory, as elastic's worker copies a batch read on its own thread
            batch = [t.to(device, non_blocking=True) for t in batch]
        optimizer.zero_grad(set_to_none=True)
        workload.loss_fn(model, batch).backward()  # DDP all-reduces the buckets during backward
        optimizer.step()
        done = step + 1
        if args.ckpt_every and done % args.ckpt_every == 0 and rank == 0:
            path = os.path.join(args.ckpt_dir, f"step_{done:09d}.pt")  # never overwrite a checkpoint
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": done}, path)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
