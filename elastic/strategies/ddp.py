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

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, src_rank: int) -> None:
        """Every replica holds the whole state, so one broadcast per dtype of every model and
        optimizer tensor, in a fixed key order, copies the source replica exactly. Used at a
        fresh start (rank 0's init becomes everyone's) and to hand a survivor's state to a
        replacement without touching storage."""
        # optimizer=None: model only. A fresh optimizer must not go through get_state_dict, which
        # initialises its state with a dummy zero-gradient step (Adam's step count would be off by one).
        state = self.state_dict(model, optimizer) if optimizer is not None else {"model": model.state_dict()}
        tensors = _tensors_in_order(state)
        group = self.mesh.get_group("dp")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for dtype in sorted(by_dtype, key=str):
                ts = by_dtype[dtype]
                flat = torch.cat([t.reshape(-1) for t in ts])
                dist.broadcast(flat, src=src_rank, group=group)
                offset = 0
                for t in ts:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        if optimizer is not None:
            self.load_state_dict(model, optimizer, state)
        else:
            model.load_state_dict(state["model"])

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


def _tensors_in_order(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors_in_order(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in_order(v)]
    return []
