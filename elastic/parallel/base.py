"""The strategy interface shared by DDP and FSDP (and, later, pipeline stages)."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from elastic.parallel import memory, meta_init, tensor
from elastic.parallel.broadcast import broadcast_tensors
from elastic.parallel.buffers import BufferSync, check_sync_batchnorm
from elastic.parallel.optim_state import prime_optimizer_state
from elastic.parallel.peer_copy import CopyStats, copy_state

_cleared = threading.local()


def forget_old_meshes(generation: int) -> None:
    """Drop DTensor's sharding-propagation caches once per process-group generation, in the
    calling thread. They are keyed by DeviceMesh equality, which ignores the process group and
    this process's coordinate in it: after a rank re-forms a same-shaped mesh under another rank
    number (a resize, a renumbering), a cached result hands out the old mesh, and DCP then writes
    this rank's shards at another rank's offsets. The Python cache is per thread, so every thread
    that touches sharded tensors calls this first."""
    if getattr(_cleared, "generation", None) != generation:
        # Imported here: the debug module costs 0.7 s of every worker's start-up otherwise.
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
        _clear_sharding_prop_cache()
        _cleared.generation = generation


class Strategy(ABC):
    name = "base"
    sharded = False  # True: a rank holds only its part of the state, so no single survivor holds it all
    # True: after `reduce_gradients` every rank of the world holds the same whole gradient, bit for
    # bit, so a rank's own sum of squares is the global one (no collective needed to learn it).
    whole_grads_everywhere = False

    needs_data = True  # whether this rank reads the step's samples (a pipeline's middle stages do not)

    def __init__(self, mesh, spec=None):
        self.mesh = mesh  # a DeviceMesh with named axes: "dp" for data parallel, "tp" with tensor parallelism
        self.spec = spec  # the job's TrainSpec (strategy options)
        self.tp = spec.tp.size if spec is not None else 1
        self._buffer_sync: BufferSync | None = None
        self._buffers_of = None  # the model `_buffer_sync` was built for

    @property
    def layout_key(self):
        """What a rank's built model depends on besides the seed: None where every rank builds the
        same (a model built before the rank joined, a spare's, is used as it is); with tensor
        parallelism, the rank's tp slice (a pipeline adds its stage)."""
        return None if self.tp == 1 else ("tp", self.tp, self.mesh.get_local_rank("tp"))

    @classmethod
    def check_job(cls, job, model_fn) -> None:
        """Before any worker starts: raise ValueError, naming the field, if this strategy cannot
        run the job's model (the driver turns it into a ConfigError). By default: no
        nn.SyncBatchNorm where torch cannot run it, the blocks named for activation checkpointing
        exist, and the built-in tensor-parallel plan fits; seen on the model built on the meta
        device."""
        tr = job.train
        needs_meta = tr.tp.size > 1 or tr.activation_checkpointing is not None or tr.meta_init
        try:
            with torch.device("meta"):
                model = model_fn()
        except Exception:  # noqa: BLE001 - a model that cannot be built on meta: nothing to check here
            if needs_meta:
                raise
            return  # (its workers build it for real; this check must not refuse what would run)
        cls.check_model(job, model)

    @classmethod
    def check_model(cls, job, model: nn.Module) -> None:
        """The checks every strategy makes on the model (built on the meta device)."""
        tr = job.train
        check_sync_batchnorm(job, model, cls.name)
        memory.select(model, tr.activation_checkpointing, "train.activation_checkpointing")
        if tr.tp.size > 1 and tr.tp.plan is None:
            tensor.check_builtin(model, tr.tp.size, tr.tp.sequence_parallel)
        if tr.meta_init and tr.init is None:
            meta_init.check(model, None)

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @property
    def grad_copies(self) -> int:
        """How many ranks hold each gradient element after the reduction (replicas hold copies,
        shards hold parts): a sum of squares over the world divided by this is the global one
        (with tensor parallelism, weighted by `grad_weights` first)."""
        return self.world_size // self.tp

    def local_grads(self, model: nn.Module) -> list[torch.Tensor]:
        """This rank's gradient tensors (the local shards of sharded ones)."""
        return [g.to_local() if hasattr(g, "to_local") else g
                for g in (p.grad for p in model.parameters()) if g is not None]

    def grad_weights(self, model: nn.Module) -> list[float] | None:
        """Per tensor of `local_grads`: 1 / the ranks of this rank's tp group that hold the same
        elements (a sum of squares over the world, weighted so, and divided by `grad_copies`, is
        the global one). None without tensor parallelism: every weight is 1."""
        if self.tp == 1:
            return None
        return [1.0 / tensor.copies_in_slot_group(p, self.tp) for p in model.parameters() if p.grad is not None]

    @property
    def loss_ranks(self) -> int:
        """How many ranks contribute a loss to the step's sum over the world."""
        return self.world_size

    def note_optimizer(self, full_model: nn.Module, make_opt) -> None:
        """Called with the unsplit model before `prepare` (a pipeline records the param groups)."""

    def train_step(self, model: nn.Module, idx: list[int], load, loss_fn, micro: int) -> torch.Tensor:
        """Forward and backward of this rank's samples `idx` (global sample ids) in micro-batches
        of `micro`; `load(ids)` returns the collated batch. The loss is a mean over each
        micro-batch; weighted so the sum over micro-batches and ranks (after the average over
        ranks) is the mean over the global batch. Returns this rank's weighted loss sum.
        Gradients are reduced by `reduce_gradients`, after."""
        local_loss = None
        for i in range(0, len(idx), micro):
            chunk = idx[i:i + micro]
            self.set_gradient_sync(model, i + micro >= len(idx))
            loss = loss_fn(model, load(chunk))
            if len(chunk) != len(idx):  # a weight of 1 would change no bit and cost two operators
                loss = loss * (len(chunk) / len(idx))
            loss.backward()
            local_loss = loss.detach() if local_loss is None else local_loss + loss.detach()
        return local_loss

    def offer(self, state: dict, rank: int, world: int, step: int, into: dict | None = None) -> dict | None:
        """This rank's part of the state for a re-shard in memory at a planned resize (copied into
        `into`'s tensors, an older part no longer needed, where they match)."""
        from elastic.parallel import resharding
        return resharding.offer(state, rank, world, step, self.tp, into)

    def prepare(self, model: nn.Module, sync_init: bool) -> nn.Module:
        """Wrap a freshly built model for this strategy. `sync_init`: make every rank's initial
        weights rank 0's first (a fresh start; skipped when state is about to be loaded anyway).
        Then, in torchtitan's order: the tensor-parallel split (each rank keeps its slice of the
        whole model it built), and activation checkpointing of the named blocks."""
        if sync_init:
            group = self.mesh.get_group("dp")
            broadcast_tensors(list(model.state_dict().values()), dist.get_global_rank(group, 0), group)
        if self.tp > 1:
            plan = self.spec.tp.plan
            model = tensor.apply(model, self.mesh["tp"], tensor.import_plan(plan) if plan else None,
                                 self.spec.tp.sequence_parallel)
        memory.checkpoint_blocks(model, self.spec.activation_checkpointing if self.spec else None)
        return model

    def finish(self, model: nn.Module) -> nn.Module:
        """The last step of a build, once the model holds its values (after `prepare` and, with
        train.meta_init, after each rank filled its part); the optimizer is built on what it returns."""
        return model

    def set_gradient_sync(self, model: nn.Module, on: bool) -> None:
        """Called before each micro-batch's backward; off for all but the last one of a step."""

    @abstractmethod
    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, src_rank: int,
                        holds: bool = False) -> CopyStats | None:
        """Make every rank's model and optimizer state equal to `src_rank`'s (replicated strategies).
        `holds`: this rank already holds that state (a survivor at the source's step); it only sends."""

    def buffer_group(self):
        """The ranks whose buffers are made equal: the `dp` axis."""
        return self.mesh.get_group("dp")

    def buffer_sync(self, model: nn.Module) -> BufferSync | None:
        """How `model`'s buffers are made equal over `buffer_group()` (None: nothing to do)."""
        if self._buffers_of is not model:
            self._buffer_sync = BufferSync.of(model, self.buffer_group())
            self._buffers_of = model
        return self._buffer_sync

    def sync_buffers(self, model: nn.Module) -> None:
        """Every replica takes the first `dp` rank's buffers (elastic/parallel/buffers.py)."""
        sync = self.buffer_sync(model)
        if sync is not None:
            sync.sync()

    @abstractmethod
    def reduce_gradients(self, model: nn.Module, extra: torch.Tensor | None = None) -> torch.Tensor | None:
        """After the last micro-batch's backward: gradients averaged over the `dp` axis, ready to
        step, and the module buffers made equal to the first `dp` rank's (`sync_buffers`).
        `extra`: a few values (the step's statistics) to sum over the whole world. A strategy whose
        reduction spans the whole world sums them in place on the same group, after its last
        gradient, and returns them: no sync point of their own. Others return None, and the caller
        sums them itself."""

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Model and optimizer state keyed by fully-qualified names, as DCP saves it (sharded
        tensors stay sharded). An optimizer that has not stepped gets its state made first, without
        DCP's zero-gradient step (optim_state.py)."""
        prime_optimizer_state(optimizer)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def full_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The whole (unsharded) state on every rank, for digests and comparisons. Collective."""
        prime_optimizer_state(optimizer)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def copy_from_replica(strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer, src_rank: int,
                      holds: bool = False) -> CopyStats | None:
    """Every rank of `src_rank`'s `dp` group is a replica of the same slot (DDP; HSDP's groups at
    one shard; a tp slice's replicas), so copying each rank's local part of every model and
    optimizer tensor, in a fixed key order, makes the state exact. On CPU (gloo) the ranks that
    hold the source's state (`holds`; the source always does) send it point to point to those that
    do not, each a share (elastic/parallel/peer_copy.py); on GPU it is still a broadcast from
    `src_rank` (elastic/parallel/broadcast.py: in place, in bounded memory; the point-to-point copy
    has not run on NCCL yet)."""
    state = strategy.state_dict(model, optimizer)
    tensors = [tensor.local(t) for t in _tensors_in_order(state)]
    group = strategy.mesh.get_group("dp")
    stats = None
    if any(t.is_cuda for t in tensors):
        broadcast_tensors(tensors, src_rank, group)
    else:
        stats = copy_state(tensors, holds or dist.get_rank() == src_rank, group)
    strategy.load_state_dict(model, optimizer, state)
    return stats


def _tensors_in_order(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors_in_order(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in_order(v)]
    return []
