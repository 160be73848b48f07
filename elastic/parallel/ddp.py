"""Data parallel with gradient buckets whose layout is a function of the model alone,
each all-reduced as soon as backward has produced it.

Why not torch's DistributedDataParallel: its reducer rebuilds gradient buckets
after the first iteration, so the first step after a restore sums gradients in
a different order than an uninterrupted run, and resumed runs are not
bit-identical (measured, see docs/architecture.md). Here the buckets are fixed:
parameters in reverse `parameters()` order (roughly the order backward
produces their gradients), cut every BUCKET_BYTES, one dtype per bucket, every
step, every run. A hook on each parameter counts its bucket down; when a
bucket is complete, it and every complete bucket before it are copied into
their own (reused) buffers, divided by the world size on the way, and
all-reduced asynchronously while backward goes on: always in bucket order, so
every rank issues the same collectives in the same order. `reduce_gradients`
waits for them and points each gradient at its slice of the averaged buffer:
one pass per gradient per step, no flat concatenation. The step's statistics
join the same group's queue after the last bucket (see `reduce_gradients`),
after the broadcast of the model's buffers from the first rank where it has
any (elastic/parallel/buffers.py: torch DDP's `broadcast_buffers`, in effect).
With gradient accumulation only the last micro-batch's backward launches
anything (`set_gradient_sync`). The last bucket's parameters have no hook: it
is launched last whatever happens, so not before backward has produced every
gradient, and `reduce_gradients` launches it then (a model of one bucket runs
no Python per parameter during backward; on a GPU each hook's Python, run from
the autograd thread, cost about as much as the copies it launched).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from elastic.parallel import compression, tensor
from elastic.parallel.base import Strategy, copy_from_replica
from elastic.parallel.tensor import like, local


BUCKET_BYTES = 25 * 2 ** 20  # as torch DDP's default bucket_cap_mb


def plan_buckets(params: list[torch.Tensor], cap_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices into `params` per bucket: reverse order, a new bucket at each dtype change or
    when the next parameter would pass the cap (a parameter larger than the cap is alone)."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i in reversed(range(len(params))):
        p = local(params[i])
        nbytes = p.numel() * p.element_size()
        if not buckets or p.dtype != dtype or size + nbytes > cap_bytes:
            buckets.append([])
            size, dtype = 0, p.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


def unhook(model: nn.Module) -> None:
    """Remove the gradient hooks a DataParallel strategy put on `model`. Each hook is held by the
    parameter's autograd metadata, in C++, and holds its strategy, which holds the parameters and
    the bucket buffers: a cycle Python's collector cannot see. A model replaced with its hooks on
    is never freed (two copies of the model's size per rebuild, until the process ends)."""
    for h in getattr(model, "elastic_grad_hooks", []):
        h.remove()
    model.elastic_grad_hooks = []


class DataParallel(Strategy):
    name = "ddp"
    overlap = True  # bucketed all-reduce during backward; False: one flat all-reduce after it

    def __init__(self, mesh, spec=None, seed: int = 0):
        super().__init__(mesh, spec)
        self._hooked = None  # the model whose gradient hooks feed this strategy's buckets
        self._sync = True
        # train.grad_compression (elastic/parallel/compression.py); None: fp32 all-reduces
        self.compressor = compression.make(getattr(spec, "grad_compression", None), seed)

    @property
    def whole_grads_everywhere(self) -> bool:
        """The dp axis is the whole world (no tensor parallelism): all-reduced buckets are equal
        on every rank."""
        return self.tp == 1

    # ---------------------------------------------------------------- tensor parallelism
    def finish(self, model: nn.Module) -> nn.Module:
        """With tensor parallelism, plain parameters outside forward (tensor.localize), as torch's
        DDP keeps them; the state dict still carries DTensors (`state_dict`)."""
        return tensor.localize(model) if self.tp > 1 else model

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        state = super().state_dict(model, optimizer)
        if self.compressor is not None and self.overlap:
            self._hook(model)  # the compressor's state is shaped by the buckets
            if shared := self.compressor.shared_state():  # equal on every replica: travels as the model does
                state["compression"] = shared
        return tensor.as_dtensors(model, state) if self.tp > 1 else state

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        super().load_state_dict(model, optimizer, tensor.as_locals(state) if self.tp > 1 else state)
        if "compression" in state:
            self._hook(model)
            compression.load(self.compressor, state["compression"], None)

    def own_state(self, model: nn.Module) -> dict:
        """State of this rank alone (error feedback), for checkpoints only: a replica's copy of it
        would be another rank's (elastic/parallel/compression.py)."""
        if self.compressor is None or not self.overlap:
            return {}
        self._hook(model)
        return self.compressor.own_state()

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, src_rank: int,
                        holds: bool = False):
        """Every replica holds the whole state, so copying every model and optimizer tensor, in a
        fixed key order, from the replicas that hold the source's state makes a replacement's
        exact without touching storage (`copy_from_replica`). With tensor parallelism, over the
        slot's `dp` group: each rank's local slice from its slot's replicas."""
        return copy_from_replica(self, model, optimizer, src_rank, holds)

    # ---------------------------------------------------------------- overlapped buckets
    def _hook(self, model: nn.Module) -> None:
        """Buckets and gradient hooks for `model`, once per strategy (a group): a survivor keeps
        its model across groups, so the hooks of an older strategy are removed first."""
        if self._hooked is model:
            return
        unhook(model)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._buckets = plan_buckets(self._params, BUCKET_BYTES)
        self._bucket_of = {i: k for k, b in enumerate(self._buckets) for i in b}
        self._numels = [local(p).numel() for p in self._params]  # this rank's part (a tp slice of a DTensor)
        self._bufs = [torch.empty(sum(self._numels[i] for i in b), dtype=self._params[b[0]].dtype,
                                  device=self._params[b[0]].device) for b in self._buckets]
        # Each parameter's slice of its bucket, and that slice as the parameter's gradient, made once:
        # slicing and viewing them every step cost 3 operators per parameter per step.
        self._slices: list[torch.Tensor] = [None] * len(self._params)
        for k, b in enumerate(self._buckets):
            offset = 0
            for i in b:
                self._slices[i] = self._bufs[k][offset:offset + self._numels[i]]
                offset += self._numels[i]
        self._grads = [like(self._slices[i], p) for i, p in enumerate(self._params)]
        # The slices in their gradients' shapes, the destinations of the copies into the buckets:
        # a reshape of each gradient every step cost an operator per parameter.
        self._into = [self._slices[i].view(local(p).shape) for i, p in enumerate(self._params)]
        index = {id(p): i for i, p in enumerate(self._params)}
        last = set(self._buckets[-1])  # launched by reduce_gradients: see the module's docstring
        model.elastic_grad_hooks = [p.register_post_accumulate_grad_hook(
            lambda p, i=index[id(p)]: self._grad_ready(i)) for i, p in enumerate(self._params)
            if i not in last]
        self._scale = 1.0 / dist.get_world_size(self.mesh.get_group("dp"))
        if self.compressor is not None:
            self.compressor.setup(self._bufs, [[local(self._params[i]).shape for i in b] for b in self._buckets],
                                  self.mesh.get_group("dp"))
        self._hooked = model
        self._begin_step()

    def _begin_step(self) -> None:
        self._missing = [len(b) for b in self._buckets]
        self._next = 0
        self._works: list = []
        if self.compressor is not None:
            self.compressor.discard()  # a step cut short by a lost peer left its updates uncommitted

    def _grad_ready(self, i: int) -> None:
        if not self._sync:
            return
        k = self._bucket_of[i]
        self._missing[k] -= 1
        while self._next < len(self._buckets) and self._missing[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, k: int) -> None:
        """Bucket `k`'s gradients, divided by the world size on their way into its buffer (one pass
        per gradient, like torch DDP's division before the all-reduce), then its all-reduce. Dividing
        after the sum instead cost a pass over every gradient after backward had ended, on the
        step's critical path (2-3 ms a step at 10 M parameters on CPU, measured). Dividing by a
        power of two is exact, so for 2, 4, 8... ranks the sum is bit-identical either way."""
        scale = self._scale
        for i in self._buckets[k]:
            grad = self._params[i].grad
            if grad is None:  # no gradient this step (an unused parameter): zeros
                self._slices[i].zero_()
            else:
                torch.mul(local(grad), scale, out=self._into[i])
        if self.compressor is not None:
            self._works.append(self.compressor.launch(k))
            return
        self._works.append(dist.all_reduce(self._bufs[k], op=dist.ReduceOp.SUM, group=self.mesh.get_group("dp"),
                                           async_op=True))

    def train_step(self, model: nn.Module, idx: list[int], load, loss_fn, micro: int) -> torch.Tensor:
        if self.overlap:
            self._hook(model)
            self._begin_step()
        return super().train_step(model, idx, load, loss_fn, micro)

    def set_gradient_sync(self, model: nn.Module, on: bool) -> None:
        self._sync = on

    def reduce_gradients(self, model: nn.Module, extra: torch.Tensor | None = None) -> torch.Tensor | None:
        """Wait for the buckets' all-reduces and point each gradient at its slice. `extra` joins
        the same group's queue right after the last bucket, so the ranks meet once per step, not
        twice (a collective of its own cost 1-3 ms a step at 10 M parameters on CPU, measured).
        A model with buffers has them broadcast from the first rank in between (buffers.py)."""
        if not self.overlap or self._hooked is not model:  # backward ran outside train_step: no buckets
            self._reduce_flat(model)
            return None
        while self._next < len(self._buckets):  # the last, and any with a gradient missing
            self._launch(self._next)
            self._next += 1
        group = self.mesh.get_group("dp")
        # The buffers' broadcast queues behind the last bucket, in the same order on every rank,
        # and is waited for with the buckets: no sync point of its own.
        buffer_sync = self.buffer_sync(model)
        buffers = buffer_sync.launch() if buffer_sync is not None else None
        if self.tp > 1:  # the dp group is not the whole world: the caller sums `extra` over it
            extra = None
        extra_work = dist.all_reduce(extra, group=group, async_op=True) if extra is not None else None
        for k, work in enumerate(self._works):
            if self.compressor is not None:
                self.compressor.finish(k, work)
            else:
                work.wait()
            for i in self._buckets[k]:
                self._params[i].grad = self._grads[i]
        self._works = []
        if self.compressor is not None:
            self.compressor.commit()
        if buffers is not None:
            buffer_sync.finish(buffers)
        if extra_work is None:
            return None
        extra_work.wait()
        return extra

    def _reduce_flat(self, model: nn.Module) -> None:
        group = self.mesh.get_group("dp")
        grad_scale = 1.0 / dist.get_world_size(group)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if grad_scale != 1.0:
            flat.mul_(grad_scale)
        offset = 0
        for p in params:
            n = local(p).numel()
            p.grad = like(flat[offset:offset + n].clone(), p)
            offset += n
        self.sync_buffers(model)
