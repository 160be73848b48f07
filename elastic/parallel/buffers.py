"""Module buffers (BatchNorm's running mean and variance, and the like) kept equal across the
replicas of a data-parallel group, and the one buffer layer elastic cannot run on a CPU.

Why: each replica's forward updates its buffers from its own samples, so without a rule they
drift apart all run long. A checkpoint then holds whichever replica's copy DCP's planner picked
(it spreads replicated tensors over the ranks to balance their writes, not rank 0's), a peer copy
holds its source's, and a recovery changes every rank's trajectory, so invariant 1 (bit-identical
to the uninterrupted run) cannot hold.

The rule is torch DDP's (`broadcast_buffers=True`) in effect: once per step every replica takes
the buffers of the group's first rank. torch broadcasts before a forward (under `no_sync`, only
before a step's first micro-batch); here the broadcast follows the step's last backward, inside
`Strategy.reduce_gradients`. Every forward therefore sees the buffers torch DDP's would give it,
and in addition every step boundary, where checkpoints and peer copies are taken, holds one value
on every replica.

Cost: one collective per step, issued only for models that have a floating-point persistent
buffer (a model with none, or only integer counters such as `num_batches_tracked`, issues
nothing). Every persistent buffer travels in it, whatever its dtype, as raw bytes: a copy, so
bit-exact by construction (negative zeros and NaN payloads included). It cost about 0.45 ms a
step at 1.3 M parameters with a BatchNorm layer (2 gloo ranks, medians of 1,000 interleaved
steps on a busy 2-CPU machine); at 10 M it was below the noise. Riding on the step statistics'
all-reduce instead (the other ranks adding -0.0, which leaves any float unchanged) cost about
0.1 ms in the same measurement, but carries only float buffers of the statistics' dtype, relies
on nothing flushing denormals, and would still need this broadcast for BatchNorm's int64 counter.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn


class BufferSync:
    """The persistent buffers of one model, broadcast from the first rank of `group` as one
    flat byte tensor. Built by `of`, which says when there is nothing to do."""

    def __init__(self, slots: list[tuple[nn.Module, str]], group):
        # (module, name), not the tensors: a module may assign a new tensor to its buffer in
        # forward (`self.ema = self.ema * m + ...`), and a cached tensor would then be stale.
        self._slots = slots
        self._group = group
        self._src = dist.get_global_rank(group, 0)
        self._is_src = dist.get_rank() == self._src

    @classmethod
    def of(cls, model: nn.Module, group) -> BufferSync | None:
        """None where no broadcast is needed: a group of one, or a model with no floating-point
        persistent buffer. Non-persistent buffers (a causal mask, a rotary table) are not part of
        the state that checkpoints and peers carry, and are constants in every model seen so far:
        they are left alone, like integer counters, which every replica advances alike."""
        if group is None or dist.get_world_size(group) < 2:
            return None
        slots = persistent_buffers(model)
        return cls(slots, group) if slots else None

    def launch(self) -> tuple:
        """Start the broadcast (asynchronous): every rank of the group must call this at the same
        point of its collective order. Pass the result to `finish`."""
        bufs = [m._buffers[n] for m, n in self._slots]
        with torch.no_grad():
            flat = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in bufs])
        return dist.broadcast(flat, src=self._src, group=self._group, async_op=True), flat, bufs

    def finish(self, pending: tuple) -> None:
        """Wait for the broadcast and copy the first rank's bytes into this rank's buffers."""
        work, flat, bufs = pending
        work.wait()
        if self._is_src:
            return
        offset = 0
        with torch.no_grad():
            for b in bufs:
                n = b.numel() * b.element_size()
                if b.is_contiguous():
                    b.view(-1).view(torch.uint8).copy_(flat[offset:offset + n])
                else:  # its own aligned copy first: a byte slice may not be viewed as a wider dtype
                    b.copy_(flat[offset:offset + n].clone().view(b.dtype).view(b.shape))
                offset += n

    def sync(self) -> None:
        self.finish(self.launch())


def persistent_buffers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every persistent buffer, or none at all when no one of them is a float
    (integer counters alone advance alike on every replica and in every retry of a step)."""
    slots = [(m, n) for _, m in model.named_modules() for n, b in m._buffers.items()
             if b is not None and n not in m._non_persistent_buffers_set]
    return slots if any(m._buffers[n].is_floating_point() for m, n in slots) else []


class StepBuffers:
    """The buffers as they were before a step's forward, put back when the step does not complete.

    A forward updates buffers in place (BatchNorm's running statistics and its counter). When a
    peer is lost in the middle of a step, the survivors' parameters and optimizer are untouched
    (nothing is updated before the step's collectives succeed), but their buffers already hold
    the aborted step's batch; the step is then redone, and that batch would count twice. Measured
    on a BatchNorm model: a node kill left every rank bit-identical to every other but not to the
    uninterrupted run, until the survivors put their buffers back."""

    def __init__(self):
        # Weak references only: a model a restore replaces must be freed (tests/test_worker.py).
        self._model: weakref.ref | None = None
        self._slots: list[tuple[weakref.ref, str]] = []
        self._saved: list[torch.Tensor] = []

    def save(self, model: nn.Module) -> None:
        if self._model is None or self._model() is not model:  # a new build (a restore, a re-shard)
            self._model = weakref.ref(model)
            self._slots = [(weakref.ref(m), n) for m, n in persistent_buffers(model)]
        with torch.no_grad():
            self._saved = [ref()._buffers[n].detach().clone() for ref, n in self._slots]

    def restore(self) -> None:
        with torch.no_grad():
            for (ref, n), saved in zip(self._slots, self._saved):
                module = ref()
                if module is not None:
                    module._buffers[n].copy_(saved)


def check_sync_batchnorm(job, model: nn.Module, strategy: str) -> None:
    """Refuse `nn.SyncBatchNorm` where it cannot run, before any worker starts (ValueError).

    torch 2.13 computes SyncBatchNorm's statistics only on GPU-like devices: in training, with a
    process group of more than one rank, its forward raises "SyncBatchNorm expected input tensor
    to be on GPU" on a CPU (tried with gloo here). In a pipeline it would also gather over the
    whole world, whose other stages never run that layer. On a GPU under ddp or fsdp it runs; its
    own all-gathers keep the running statistics equal, and the buffer broadcast costs nothing more
    than for BatchNorm."""
    layers = [name or "(root)" for name, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if not layers:
        return
    if strategy == "pipeline":
        why = ("train.strategy=pipeline: SyncBatchNorm would gather its statistics over the whole "
               "world, whose other stages never run that layer")
    elif not job.scaling.use_gpu:
        why = ("scaling.use_gpu is false, and torch computes SyncBatchNorm's statistics only on a GPU "
               "(on a CPU its forward raises 'SyncBatchNorm expected input tensor to be on GPU')")
    else:
        return
    raise ValueError(f"train.model: nn.SyncBatchNorm at {layers[:5]}{' ...' if len(layers) > 5 else ''} cannot run: "
                     f"{why}. Use nn.BatchNorm1d/2d/3d instead: elastic keeps every replica's buffers equal "
                     f"(the first data-parallel rank's, broadcast once per step), as torch DDP does "
                     f"(docs/limitations.md)")
