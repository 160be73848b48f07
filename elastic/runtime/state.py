"""One rank's trainable state: the model and optimizer (and fp16's loss scale) built from the seed
and prepared for the strategy, the state dict that checkpoints and peers carry, the learning-rate
schedule replayed to the step, and a digest that compares the whole state across ranks and runs.

Functions of the worker (`w`), whose attributes (`model`, `optimizer`, `scheduler`, `amp`) hold
the state; every restore path (elastic/runtime/restore.py) goes through here.
"""
from __future__ import annotations

import copy
import hashlib
import logging
from typing import TYPE_CHECKING

import torch

from elastic.parallel import meta_init
from elastic.parallel.ddp import unhook
from elastic.runtime.step import LOSS_SCALE_INIT

if TYPE_CHECKING:
    from elastic.runtime.worker import Worker

log = logging.getLogger(__name__)

META = ("meta",)  # `built_for` of a spare's model kept on the meta device: built again on joining


def default_optimizer(params):
    """The optimizer of a job that names none (train.optimizer)."""
    return torch.optim.AdamW(params, lr=1e-3)


def trainable_only(make_opt):
    """The job's optimizer factory, given only the parameters that train: one with
    requires_grad=False (a frozen backbone, an adapter's base) is in no param group and gets no
    optimizer state, under every strategy."""
    def make(params):
        return make_opt([p for p in params if p.requires_grad])
    return make


def build(w: Worker, sync_init: bool = False, fill: bool = True, copied: bool = False) -> None:
    """Model and optimizer from the seed; once in a group, prepared for the strategy (FSDP
    shards it over the current mesh, so every world size gets a fresh build). `fill=False`: a
    state is loaded over it next, so train.meta_init allocates this rank's part without
    initialising it (meta_init.materialize), and a sharded strategy's model builds the same way
    where it can (`_meta_for_load`); `copied`: that state is a peer's copy of every tensor, so a
    replicated strategy's model builds that way too."""
    if w.model is not None:
        # The model being replaced is freed before its successor is built (one model's memory,
        # not two, at the peak); its gradient hooks would otherwise keep it alive for good.
        unhook(w.model)
        w.model = w.optimizer = w.scheduler = None
    torch.manual_seed(w.job.run.seed)
    tr = w.job.train
    if tr.meta_init:  # elastic/parallel/meta_init.py: split on meta, then each rank allocates its part
        with torch.device("meta"):
            model = w.fns["model"]()
        template = copy.deepcopy(model)
        if w.strategy is None:  # a spare: stays on meta (no memory) until it joins and knows its part
            w.model, w.optimizer, w.built_for = model, None, META
            return
    elif not fill and (model := _meta_for_load(w, copied)) is not None:
        template = copy.deepcopy(model)
    elif _builds_on_host(tr):
        # FSDP's CPU offload: fully_shard moves one block at a time to the device, shards it and
        # offloads the shard, so the device never holds more than a block. Moved whole first, the
        # device held the whole model (340.8 M parameters: 2,612 MiB at the build's peak on an
        # H100 with the broadcast's flat copy, docs/benchmarks/gpu.md), what offload is for.
        model, template = w.fns["model"](), None
    else:
        model, template = w.fns["model"]().to(w.device), None
    make_opt = trainable_only(w.fns["optimizer"] or default_optimizer)
    if w.strategy:
        w.strategy.note_optimizer(model, make_opt)
        # A meta model needs no broadcast: every rank computes the same values from the seed.
        model = w.strategy.prepare(model, sync_init and template is None)
    if template is not None:
        meta_init.materialize(model, template, w.device, w.job.run.seed, w.fns["init"], fill)
    if w.strategy:
        model = w.strategy.finish(model)
    w.model = model
    w.built_for = w.strategy.layout_key if w.strategy else None
    w.built_generation = w.generation  # the group whose mesh the model's DTensors are bound to
    w.optimizer = make_opt(w.model.parameters())
    w.factory_lrs = [g["lr"] for g in w.optimizer.param_groups]  # where a schedule starts
    if w.job.train.precision == "fp16":
        w.amp = {"good_steps": torch.zeros((), dtype=torch.int64, device=w.device),
                 "scale": torch.full((), LOSS_SCALE_INIT, device=w.device)}


def ready_for_a_copy(w: Worker) -> None:
    """A calibrated spare of a layout whose ranks each hold the whole model (DDP at tp 1) joins
    with the model it built, so its optimizer's state is made now, off the critical path: a
    restore's copy then lands in memory already touched (AdamW's 720 MB at 90 M: 0.31-0.54 s
    here, most of it the pages' first touch, which the copy paid;
    benchmarks/probes/copy_ready.py). Other layouts build again as they join: nothing to make
    early."""
    from elastic.parallel.optim_state import prime_optimizer_state
    from elastic.parallel.shape import shape_for
    shape = shape_for(w.job)
    if w.optimizer is not None and shape.unit == 1 and not shape.sharded:
        prime_optimizer_state(w.optimizer)


def load_pretrained(w: Worker) -> None:
    """train.init_from over a fresh build (elastic/checkpoint/pretrained.py), written into the
    model's own tensors: each rank reads its part of each (a DTensor's local shard, a localized
    tp parameter's slice); the optimizer's state is not made for it (no memory beyond the
    model's part and one tensor's slice at a time)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from elastic.checkpoint import pretrained
    from elastic.parallel.tensor import as_dtensors
    tr = w.job.train
    held = as_dtensors(w.model, {"model": get_model_state_dict(w.model), "optim": {"state": {}}})
    # A pipeline rank holds a stage: the whole model's names tell its unexpected ones.
    whole = pretrained.model_shapes(w.fns["model"]) if w.strategy.name == "pipeline" else None
    missing, unexpected = pretrained.load_into(held["model"], tr.init_from, w.storage.options,
                                               tr.init_strict, w.ckpt_pg, whole)
    if missing or unexpected:
        log.warning("train.init_from %s: missing from it %s; not in the model %s", tr.init_from,
                    missing, unexpected)


def _meta_for_load(w: Worker, copied: bool = False):
    """A model for a restore, which loads every tensor of the state over it: built on the meta
    device, so that each rank then allocates only its part and runs none of the model's init (at
    90 M parameters and 3 ranks on 2 cores the eager build took 5.9 s of a re-shard's 10.3). For
    a sharded strategy's rank; and for a worker not in a group yet whose model will be loaded
    over before it trains (one started for a recovery or a resize: its init, 0.5 s of a 0.8 s
    build at 90 M here, benchmarks/probes/warm_build.py, was thrown away). None where the eager build is needed: a replicated strategy's rank (a
    restore from storage builds it again anyway), a model with non-persistent buffers (no state
    carries their values; the model function computes them), one that cannot be built on meta,
    and CPU offload (its build stays in host memory). `copied`: the state comes whole from a peer's
    memory (runtime/restore.py's from_peer), so a replicated rank builds on meta too: its init was
    written over by the copy (the DDP build at 90 M here: 0.64-0.83 s eager, 0.23-0.54 on meta,
    benchmarks/probes/copy_ready.py)."""
    replicated = w.strategy is not None and not w.strategy.sharded
    if (replicated and not copied) or _builds_on_host(w.job.train):
        return None
    try:
        with torch.device("meta"):
            model = w.fns["model"]()
    except Exception:  # noqa: BLE001 - a model function that needs real tensors: the eager build
        return None
    if any(meta_init.non_persistent(m) for m in model.modules()) or not meta_init.on_meta(model):
        return None
    return model


def _builds_on_host(tr) -> bool:
    """An eager build that stays in host memory until the strategy places it: FSDP with CPU
    offload, without tensor parallelism (whose DTensors must be on the mesh's device)."""
    return tr.strategy == "fsdp" and tr.fsdp.offload and tr.tp.size == 1


def rebind(w: Worker) -> None:
    """A survivor with tensor parallelism, in a new group: its DTensors (and the plan's hooks) are
    bound to the old group's mesh, whose process groups are gone. Build the model again on the new
    mesh (the same slot, so the same local shapes) and move this rank's tensors into it, model and
    optimizer alike: nothing is communicated, and the state is exactly what it held."""
    from elastic.parallel.resharding import flatten
    from elastic.parallel.tensor import local
    w.forget_old_meshes()
    held = {path: local(t) for path, t in flatten(state_dict(w)) if isinstance(t, torch.Tensor)}
    amp = w.amp
    build(w, fill=False)  # every tensor is moved in from the old build next
    fresh = state_dict(w)
    with torch.no_grad():
        for path, t in flatten(fresh):
            if isinstance(t, torch.Tensor):
                local(t).copy_(held.pop(path))
    load_state(w, fresh)
    if amp:
        w.amp = amp


def state_dict(w: Worker) -> dict:
    """Everything a restore must bring back, keyed by name: model, optimizer and (fp16) the
    loss scale. The learning-rate schedule is a function of the step (see replay_schedule)."""
    state = w.strategy.state_dict(w.model, w.optimizer)
    if w.amp:
        state["amp"] = w.amp
    if own := own_state(w):
        # Keyed by rank: each rank writes and reads its own (train.grad_compression's error
        # feedback), so a restore from storage brings every rank's back, a lost one's included.
        state["compression_own"] = {f"rank{w.rank}": own}
    return state


def own_state(w: Worker) -> dict:
    """The strategy's state of this rank alone (elastic/parallel/compression.py), or {}."""
    return w.strategy.own_state(w.model) if hasattr(w.strategy, "own_state") else {}


def load_state(w: Worker, state: dict) -> None:
    w.strategy.load_state_dict(w.model, w.optimizer, state)
    if w.amp:
        w.amp = state["amp"]
    own = own_state(w)
    for key, t in state.get("compression_own", {}).get(f"rank{w.rank}", {}).items():
        if own[key] is not t:
            own[key].copy_(t)


def replay_schedule(w: Worker) -> None:
    """The schedule at this step, as an uninterrupted run has it: built on the optimizer with
    each group's initial learning rate and stepped once per step done. Exact for any
    schedule that depends only on the step count, whatever path the state came by."""
    make = w.fns["scheduler"]
    if make is None:
        return
    for g, lr in zip(w.optimizer.param_groups, w.factory_lrs):
        g["lr"] = lr
        g.pop("initial_lr", None)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": a replay
        w.scheduler = make(w.optimizer)
        for _ in range(w.step):
            w.scheduler.step()


def digest(w: Worker) -> str:
    """sha256 over the whole (unsharded) model and optimizer state in a fixed order: equal
    digests, equal state, whatever the layout. Collective for sharded strategies: each sharded
    tensor is gathered whole on its own, hashed and dropped, so the peak is one tensor, never the
    whole state (a model larger than one worker still has a digest)."""
    h = hashlib.sha256()
    w.forget_old_meshes()
    state = w.strategy.state_dict(w.model, w.optimizer)
    for section in ("model", "optim"):
        _hash_into(h, state[section])
    return h.hexdigest()


def _hash_into(h, obj) -> None:
    if hasattr(obj, "full_tensor"):  # a DTensor: its whole value, gathered from every part
        obj = obj.full_tensor()
    if isinstance(obj, torch.Tensor):
        h.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if obj.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _hash_into(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _hash_into(h, v)
    else:
        h.update(repr(obj).encode())


def local_bytes(w: Worker) -> int:
    """Bytes of model and optimizer state this rank holds (a sharded or tensor-parallel tensor:
    its local part): what a restore from a peer moves into it."""
    tensors = list(w.model.state_dict().values())
    tensors += [v for per_param in w.optimizer.state.values() for v in per_param.values()]
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total
