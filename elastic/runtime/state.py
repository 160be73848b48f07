"""One rank's trainable state: the model and optimizer (and fp16's loss scale) built from the seed
and prepared for the strategy, the state dict that checkpoints and peers carry, the learning-rate
schedule replayed to the step, and a digest that compares the whole state across ranks and runs.

Functions of the worker (`w`), whose attributes (`model`, `optimizer`, `scheduler`, `amp`) hold
the state; every restore path (elastic/runtime/restore.py) goes through here.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from elastic.parallel.ddp import unhook
from elastic.runtime.step import LOSS_SCALE_INIT

if TYPE_CHECKING:
    from elastic.runtime.worker import Worker


def build(w: Worker, sync_init: bool = False) -> None:
    """Model and optimizer from the seed; once in a group, prepared for the strategy (FSDP
    shards it over the current mesh, so every world size gets a fresh build)."""
    if w.model is not None:
        # The model being replaced is freed before its successor is built (one model's memory,
        # not two, at the peak); its gradient hooks would otherwise keep it alive for good.
        unhook(w.model)
        w.model = w.optimizer = w.scheduler = None
    torch.manual_seed(w.job.run.seed)
    model = w.fns["model"]().to(w.device)
    make_opt = w.fns["optimizer"] or (lambda p: torch.optim.AdamW(p, lr=1e-3))
    if w.strategy:
        w.strategy.note_optimizer(model, make_opt)
        model = w.strategy.prepare(model, sync_init)
    w.model = model
    w.built_for = w.strategy.layout_key if w.strategy else None
    w.optimizer = make_opt(w.model.parameters())
    w.factory_lrs = [g["lr"] for g in w.optimizer.param_groups]  # where a schedule starts
    if w.job.train.precision == "fp16":
        w.amp = {"good_steps": torch.zeros((), dtype=torch.int64, device=w.device),
                 "scale": torch.full((), LOSS_SCALE_INIT, device=w.device)}


def state_dict(w: Worker) -> dict:
    """Everything a restore must bring back, keyed by name: model, optimizer and (fp16) the
    loss scale. The learning-rate schedule is a function of the step (see replay_schedule)."""
    state = w.strategy.state_dict(w.model, w.optimizer)
    if w.amp:
        state["amp"] = w.amp
    return state


def load_state(w: Worker, state: dict) -> None:
    w.strategy.load_state_dict(w.model, w.optimizer, state)
    if w.amp:
        w.amp = state["amp"]


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
    digests, equal state. Collective for sharded strategies."""
    h = hashlib.sha256()
    w.forget_old_meshes()
    state = w.strategy.full_state_dict(w.model, w.optimizer)
    for section in ("model", "optim"):
        _hash_into(h, state[section])
    return h.hexdigest()


def _hash_into(h, obj) -> None:
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
