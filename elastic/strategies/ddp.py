"""Data parallel with one flat gradient all-reduce in fixed parameter order.

Why not torch's DistributedDataParallel: its reducer rebuilds gradient buckets
after the first iteration, so the first step after a restore sums gradients in
a different order than an uninterrupted run, and resumed runs are not
bit-identical (measured, see shared/DESIGN.md). Here the reduction layout is a
function of the model alone: every step, every run, the same single buffer in
`named_parameters()` order. For the small and medium models this targets, one
flat all-reduce is also as fast as bucketing on gloo.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from elastic.strategies.base import Strategy, broadcast_tensors


class DataParallel(Strategy):
    name = "ddp"

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, src_rank: int) -> None:
        """Every replica holds the whole state, so one broadcast per dtype of every model and
        optimizer tensor, in a fixed key order, copies the source replica exactly: how a
        replacement gets a survivor's state without touching storage."""
        state = self.state_dict(model, optimizer)
        broadcast_tensors(_tensors_in_order(state), src_rank, self.mesh.get_group("dp"))
        self.load_state_dict(model, optimizer, state)

    def reduce_gradients(self, model: nn.Module) -> None:
        group = self.mesh.get_group("dp")
        grad_scale = 1.0 / dist.get_world_size(group)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if grad_scale != 1.0:
            flat.mul_(grad_scale)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n


def _tensors_in_order(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors_in_order(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in_order(v)]
    return []
