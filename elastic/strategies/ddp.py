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

from elastic.strategies.base import Strategy


class DataParallel(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        # Every rank built the model from the same seed; broadcasting rank 0's copy makes
        # that an invariant rather than an assumption about the user's factory.
        group = self.mesh.get_group("dp")
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
            offset = 0
            for p in model.parameters():
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return model

    def reduce_gradients(self, model: nn.Module, grad_scale: float) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.mesh.get_group("dp"))
        if grad_scale != 1.0:
            flat.mul_(grad_scale)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
