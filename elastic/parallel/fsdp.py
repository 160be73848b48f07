"""Fully sharded data parallel with PyTorch's `fully_shard` (FSDP2).

Each rank holds 1/W of every parameter, gradient and optimizer moment (dim-0
shards, DTensors on the `dp` mesh axis). Forward and backward all-gather one
block's parameters at a time; backward reduce-scatters its gradients, averaged
over the ranks. So the model is wrapped block by block (`train.fsdp.blocks`,
or a default: the elements of every `nn.ModuleList`, else the children of an
`nn.Sequential` root), then the root.

Sharded state means no single survivor holds it all: a rank lost to a fault
takes its shards with it, so a failure restores from the in-memory copy another
node holds (elastic/runtime/memory_copies.py), else from the newest committed
checkpoint (DCP re-shards on load to whatever the world size is). Planned
changes (growth, a straggler swapped or dropped) re-shard in memory from every
old rank's shards (`elastic.parallel.resharding`).

CPU offload (`train.fsdp.offload`): FSDP2's `CPUOffloadPolicy`, so every copy, checkpoint and
re-shard above reads host tensors where it would read device ones.

HSDP (`train.fsdp.replicate` > 1): a 2-D mesh ("dp", "shard"), ("dp", "shard",
"tp") with tensor parallelism. Each replica group shards the state over its
"shard" ranks (each tp slice, with tp); the ranks at one shard coordinate (and
tp index) across groups ("dp") hold the same part, so a lost rank is copied
from its peer at the same coordinate, like a DDP replica (`broadcast_state`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from elastic.parallel.base import Strategy, copy_from_replica
from elastic.parallel.memory import select


def default_blocks(model: nn.Module) -> list[nn.Module]:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        return [b for ml in lists for b in ml if any(True for _ in b.parameters())]
    if isinstance(model, nn.Sequential):
        return [c for c in model.children() if any(True for _ in c.parameters())]
    return []


def select_blocks(model: nn.Module, class_names: list[str] | None) -> list[nn.Module]:
    if class_names is None:
        return default_blocks(model)
    return select(model, class_names, "train.fsdp.blocks")  # nested matches would be sharded twice: outermost


class FullyShardedDataParallel(Strategy):
    name = "fsdp"
    sharded = True

    @classmethod
    def check_job(cls, job, model_fn) -> None:
        """Build the model on the meta device (no memory, no init) to check the wrap plan now."""
        with torch.device("meta"):
            model = model_fn()
        cls.check_model(job, model)
        select_blocks(model, job.train.fsdp.blocks)

    @property
    def hybrid(self) -> bool:
        return "shard" in (self.mesh.mesh_dim_names or ())

    @property
    def data_mesh(self):
        """The mesh FSDP shards (and HSDP replicates) over: every axis but tp."""
        if self.tp == 1:
            return self.mesh
        return self.mesh[tuple(n for n in self.mesh.mesh_dim_names if n != "tp")]

    @property
    def layout_key(self):
        """HSDP: the rank's shard (its parameters' local shapes), and its tp slice; else as the base says."""
        if self.hybrid:
            return ("shard", self.mesh["shard"].size(), self.mesh.get_local_rank("shard")) + (super().layout_key or ())
        return super().layout_key

    @property
    def grad_copies(self) -> int:
        """Each rank holds its own part of each gradient; HSDP: every replica group holds it."""
        return self.mesh["dp"].size() if self.hybrid else 1

    def prepare(self, model: nn.Module, sync_init: bool) -> nn.Module:
        model = super().prepare(model, sync_init)  # rank 0's init, broadcast; then tp and checkpointing
        # The mesh's device, not the parameters': a meta-init build (on meta) and an offload build
        # (in host memory) train on the GPU all the same.
        on_gpu = self.mesh.device_type == "cuda"
        fs = self.spec.fsdp
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, fs.param_dtype),
                                  reduce_dtype=getattr(torch, fs.reduce_dtype))
        if self.spec.precision != "fp32" and fs.param_dtype == fs.reduce_dtype == "float32" and on_gpu:
            # train.precision sets FSDP's compute and reduce dtypes unless train.fsdp sets them (GPU only:
            # on CPU, autocast alone; gloo's reduce-scatter is float32 there).
            dtype = torch.bfloat16 if self.spec.precision == "bf16" else torch.float16
            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        # With tensor parallelism the parameters are DTensors on the mesh's tp axis already: sharding
        # them over the data axes makes them 2-D (FSDP2 + TP, as torchtitan composes them), 3-D with HSDP.
        # HSDP: the 2-D ("dp", "shard") mesh: fully_shard replicates over its first axis.
        kw = dict(mesh=self.data_mesh, mp_policy=mp)
        if fs.offload:  # shards, gradients and (so) the optimizer's state in host memory
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=on_gpu)
        for block in select_blocks(model, fs.blocks):
            fully_shard(block, reshard_after_forward=fs.reshard_after_forward, **kw)
        fully_shard(model, **kw)
        return model

    def set_gradient_sync(self, model: nn.Module, on: bool) -> None:
        model.set_requires_gradient_sync(on)

    def reduce_gradients(self, model: nn.Module, extra: torch.Tensor | None = None) -> None:
        """The last micro-batch's backward reduce-scattered the gradients, averaged over the
        ranks. Left: the buffers, which `fully_shard` does not shard (each rank holds a whole copy
        and updates it from its own samples), broadcast from the first rank (buffers.py)."""
        self.sync_buffers(model)

    def buffer_group(self):
        """Buffers are not sharded: every rank of the world takes the first rank's (HSDP: the
        "dp" axis alone would leave the shard groups apart)."""
        return dist.group.WORLD if self.hybrid else super().buffer_group()

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, src_rank: int,
                        holds: bool = False):
        """HSDP: each rank's shards, model and optimizer, from the rank at the same shard in
        another replica group (`src_rank`), over the "dp" axis, in a fixed key order."""
        if not self.hybrid:
            raise RuntimeError("fsdp state is sharded: no one rank holds it all; re-shard from every rank's "
                               "shards (elastic.parallel.resharding) or load a checkpoint")
        return copy_from_replica(self, model, optimizer, src_rank, holds)
