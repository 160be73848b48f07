"""Meta-device init: the model is built on the meta device (no memory), split for the layout
(stage cut, tensor slices, FSDP shards, all on meta), and only then does each rank allocate and
initialise its own part.

Values must not depend on the layout (invariant: the same seed gives the same weights at any
dp, pp and tp). So they are computed one module at a time, on the CPU, at full size: every
module with tensors of its own (a Linear, an Embedding, a LayerNorm) is copied alone (its
children stay on meta), materialised, seeded from the run's seed and the module's
fully-qualified name, and initialised by its `reset_parameters()` (and `train.init`, if set);
each rank then keeps the slice of each tensor that its layout gives it (DTensor's own slicing:
`distribute_tensor(..., src_data_rank=None)`, no communication). The peak is one module's full
tensors beside the rank's part, never the whole model.

The weights differ from those of the same model built eagerly (the eager build draws every
module from one sequence of random numbers); they are the same for every layout of a meta-init
run, and every rank of every replica builds the same ones.
"""
from __future__ import annotations

import copy
import hashlib

import torch
from torch import nn


class MetaInitError(ValueError):
    """The model cannot be initialised one module at a time; the message names what to do."""


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in _own_tensors_all(model))


def _own_tensors_all(model: nn.Module):
    yield from model.parameters()
    yield from model.buffers()


def _owns_tensors(module: nn.Module) -> bool:
    return any(t is not None for t in module._parameters.values()) or \
        any(t is not None for t in module._buffers.values())


def seed_of(seed: int, name: str) -> int:
    """The seed of module `name`'s init: a function of the run's seed and the name only."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") % 2 ** 63


def check(model: nn.Module, init_fn) -> None:
    """Before any worker starts (the model built on meta): every module with tensors of its own
    can be initialised alone."""
    if init_fn is not None:
        return
    bare = [name or "(root)" for name, m in model.named_modules()
            if _owns_tensors(m) and not callable(getattr(m, "reset_parameters", None))]
    if bare:
        raise MetaInitError(
            f"train.meta_init: modules {bare[:5]}{' ...' if len(bare) > 5 else ''} hold parameters or buffers of "
            f"their own but have no reset_parameters(), so nothing can initialise them after the meta build. "
            f"Give them a reset_parameters(), or set train.init: module:function(name, module) that initialises "
            f"one module's own tensors in place")


def materialize(model: nn.Module, template: nn.Module, device: torch.device, seed: int, init_fn=None,
                fill: bool = True) -> None:
    """Allocate `model`'s tensors (this rank's parts) on `device` and fill them. `template`: the
    model as built, on meta, before any split (its module names are the model's). `fill=False`:
    the state is about to be loaded over them (a restore from storage), so a module whose own
    tensors all travel in the state dict (parameters, persistent buffers) is not initialised; its
    floating-point tensors are set to NaN instead, so that one a load missed could not pass for
    trained values. A module with a non-persistent buffer (not in any checkpoint) is initialised."""
    model.to_empty(device=device)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not _owns_tensors(module):
                continue
            if not fill and not non_persistent(module):
                for t in (*module._parameters.values(), *module._buffers.values()):
                    if t is not None and t.is_floating_point():
                        t.fill_(float("nan"))
                continue
            full = _full_module(template.get_submodule(name), name, seed, init_fn)
            for kind in ("_parameters", "_buffers"):
                for key, target in getattr(module, kind).items():
                    if target is not None:
                        _fill(target, getattr(full, kind)[key])


def non_persistent(module: nn.Module) -> bool:
    return any(module._buffers.get(k) is not None for k in module._non_persistent_buffers_set)


def _full_module(src: nn.Module, name: str, seed: int, init_fn) -> nn.Module:
    """`src` alone at full size on the CPU, initialised from (seed, name)."""
    full = copy.copy(src)  # its own tensors only: children stay the template's (on meta)
    full._parameters = dict(src._parameters)
    full._buffers = dict(src._buffers)
    full._modules = {k: _Stub() for k in src._modules}  # reset_parameters of this module only
    full.to_empty(device="cpu", recurse=False)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed_of(seed, name))
    try:
        if init_fn is not None:
            init_fn(name, full)
        else:
            full.reset_parameters()
    finally:
        torch.random.set_rng_state(state)
    return full


class _Stub(nn.Module):
    """Stands in for a child while one module is initialised alone."""

    def reset_parameters(self) -> None:
        pass


def _fill(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` into `target` (a DTensor's local shard, or all of it)."""
    if hasattr(target, "placements"):
        from torch.distributed.tensor import distribute_tensor
        part = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target._local_tensor.copy_(part._local_tensor)
    else:
        target.copy_(full)
