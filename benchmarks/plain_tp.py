"""The no-framework peer of `python -m benchmarks parallel`: examples/gpt.py with tensor
parallelism written the way torch's tensor-parallel tutorial and torchtitan write it, in plain
processes started by torchrun, on gloo.

    GPT_LAYERS=4 GPT_DIM=256 python -m torch.distributed.run --standalone --nproc-per-node 4 \
        -m benchmarks.plain_tp --strategy fsdp --tp 2 --steps 60

Everything but the framework is elastic's: the model (built from the same seed on every rank),
the plan (the same `ColwiseParallel` / `RowwiseParallel` styles on the same layers:
`elastic.parallel.tensor.builtin_plans` names them), the data (the example's dataset,
`default_collate` of the indices elastic's global sample order gives each replica), the
optimizer with the step clock, and the global batch.

Set up to win, as torchtitan composes it: one `DeviceMesh` of (dp, tp); `parallelize_module` per
block (`--sequence-parallel`: torchtitan's `SequenceParallel` norms between `Shard(1)` inputs and
outputs); fsdp: `fully_shard` on `mesh["dp"]` per block, then the root (FSDP2 + TP, 2-D); ddp:
torch's `DistributedDataParallel` with `device_mesh=mesh["dp"]` (its 2-D mode with TP). No loss
all-reduce, no `.item()`, no checkpoint.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.utils.data import default_collate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plain_tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel ranks; the rest of the world is dp")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="also split the blocks' norms and residual stream along the sequence (torch's SequenceParallel)")
    args = p.parse_args(argv)
    if min(args.tp, args.steps, args.global_batch) < 1:
        p.error("--tp, --steps and --global-batch must be >= 1")
    if args.sequence_parallel and args.tp < 2:
        p.error("--sequence-parallel needs --tp >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.plain_pipeline import split_tensors, timed_optimizer
    from elastic.data.order import GlobalOrder  # the sample order only: a pure function of (len, seed)
    from elastic.parallel.tensor import builtin_plans  # which layers split how (the plan, not a framework)
    from examples.gpt import build_dataset, build_model, loss_fn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.tp:
        print(f"world size {world} is not a multiple of --tp {args.tp}", file=sys.stderr)
        return 2
    dp = world // args.tp
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(args.seed)
    model = build_model()
    if args.tp > 1 and not args.sequence_parallel:
        split_tensors(model, mesh["tp"])
    elif args.tp > 1:
        plans = builtin_plans(model)
        for i, (name, plan) in enumerate(plans.items()):
            block = model.get_submodule(name)
            # torchtitan's layout: norms on sequence parts, gathered into the column-wise Linears.
            styles = {c: ColwiseParallel(input_layouts=Shard(1)) if s == "colwise"
                      else RowwiseParallel(output_layouts=Shard(1)) for c, s in plan.items()}
            parallelize_module(block, mesh["tp"], {**styles, "ln1": SequenceParallel(), "ln2": SequenceParallel()})
            if i == 0:
                parallelize_module(block, mesh["tp"], PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
            if i == len(plans) - 1:
                parallelize_module(block, mesh["tp"], PrepareModuleOutput(
                    output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
    if args.strategy == "fsdp":
        for block in model:  # every child with parameters, then the root: elastic's default units
            if any(True for _ in block.parameters()):
                fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        model = DDP(model, device_mesh=mesh["dp"]) if args.tp > 1 else DDP(model)
    optimizer = timed_optimizer(model.parameters())
    dataset = build_dataset()
    order = GlobalOrder(len(dataset), args.seed)
    replica = mesh.get_local_rank("dp")
    for step in range(args.steps):
        idx = order.rank_indices(step, args.global_batch, dp, replica)
        loss_fn(model, default_collate([dataset[j] for j in idx])).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        sp = " with sequence parallelism" if args.sequence_parallel else ""
        print(f"plain_tp: {args.strategy} dp {dp} x tp {args.tp}{sp}, {args.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
