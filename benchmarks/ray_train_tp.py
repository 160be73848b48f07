"""Tensor parallelism for the Ray Train peer (`benchmarks/ray_train_peer.py`, `python -m
benchmarks recovery --tp 2`), the way a Ray Train user who wants it to win writes it: Ray Train
starts the workers and the process group; the training function does what torch's
tensor-parallel tutorial and torchtitan do, as the plain peer of `benchmarks parallel` does
(`benchmarks/plain_tp.py`): one `DeviceMesh` of (dp, tp), the built-in plan's layers of
examples/gpt.py split with torch's `ColwiseParallel` / `RowwiseParallel`, then FSDP2 on the dp
axis (fsdp), or (ddp) the gradients all-reduced over the dp axis after backward. Not torch's DDP
with `device_mesh`, as the plain peer trains: it swaps the DTensor parameters for local ones
outside forward, and DCP's `get_state_dict` then fails to map the optimizer's state ("KeyError").
Checkpoints are distributed
(`benchmarks/ray_train_fsdp.py`'s save and load: every worker writes its own DCP files and
reports them, Ray Train merges them).

Ray Train gives a node's workers consecutive world ranks, and the mesh puts tp innermost, so a tp
group sits on one node when the cluster packs it there (0.5 CPU per worker on one-CPU nodes).
Data follows the dp coordinate: both ranks of a tp group train on the same micro-batch, a fixed
slice of elastic's global sample order, so a resume at step s sees the same samples.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import default_collate

from examples import gpt


def build(seed: int, strategy: str, tp: int, world_size: int, use_gpu: bool) -> tuple[nn.Module, object, object]:
    """(model, optimizer, mesh): the gpt example split over tp and replicated (ddp) or sharded
    (fsdp) over dp, from the seed, the same on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from benchmarks.plain_pipeline import split_tensors

    if world_size % tp:
        raise ValueError(f"world size {world_size} is not a multiple of tp {tp}")
    mesh = init_device_mesh("cuda" if use_gpu else "cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = gpt.build_model()
    if use_gpu:
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    split_tensors(model, mesh["tp"])
    if strategy == "fsdp":
        for block in model:  # every child with parameters, then the root: elastic's default units
            if any(True for _ in block.parameters()):
                fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, gpt.build_optimizer(model.parameters()), mesh


def train_step(model: nn.Module, optimizer, dataset, order, step: int, global_batch: int, mesh,
               strategy: str) -> torch.Tensor:
    """One optimizer step on this replica's share of step `step`'s global batch."""
    dp = mesh["dp"].size()
    idx = order.rank_indices(step, global_batch, dp, mesh.get_local_rank("dp"))
    x, y = default_collate([dataset[j] for j in idx])
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    loss = gpt.loss_fn(model, (x.to(device), y.to(device)))
    loss.backward()
    if strategy == "ddp" and dp > 1:  # what DDP does, in one pass after backward: the replicas' mean
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor
        group = mesh["dp"].get_group()
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(g, group=group)
                g.div_(dp)
    optimizer.step()
    return loss
