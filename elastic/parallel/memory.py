"""Memory techniques for models that do not fit: activation checkpointing of named blocks.

`train.activation_checkpointing: [Block]` makes every module of those classes keep only its
inputs in forward and recompute its activations in backward (`torch.utils.checkpoint`,
non-reentrant, as torch recommends). The module's `forward` is wrapped in place, so its
parameters keep their fully-qualified names: checkpoints move between runs with and without it,
and FSDP's and tensor parallelism's hooks (on the module's call) are untouched. The recompute
replays the forward's RNG state (`preserve_rng_state`), so dropout draws the same masks and a
step is bit-identical with and without it.
"""
from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def select(model: nn.Module, class_names: list[str] | None, field: str) -> list[nn.Module]:
    """The outermost submodules of the named classes; ValueError naming `field` if none match."""
    if class_names is None:
        return []
    wanted = set(class_names)
    blocks = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
    if not blocks:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"{field}={class_names}: no submodule of that class; the model has {present}")
    inner = {id(c) for b in blocks for c in b.modules() if c is not b}
    return [b for b in blocks if id(b) not in inner]


def checkpoint_blocks(model: nn.Module, class_names: list[str] | None) -> int:
    """Wrap the forward of every selected block (once; a rebuilt model is wrapped again).
    Returns how many blocks are checkpointed."""
    blocks = select(model, class_names, "train.activation_checkpointing")
    for block in blocks:
        if getattr(block, "elastic_checkpointed", False):
            continue
        block.forward = functools.partial(_recomputed, block.forward)
        block.elastic_checkpointed = True
    return len(blocks)


def _recomputed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def state_bytes(model_fn, make_opt) -> int | None:
    """Bytes of the model's parameters and buffers and its optimizer's state, from a build on the
    meta device and one optimizer step there (which creates the state, shaped as it will be, at no
    cost). None when the model or the optimizer cannot run on meta."""
    import torch
    try:
        with torch.device("meta"):
            model = model_fn()
        params = [p for p in model.parameters() if p.requires_grad]
        total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        opt = make_opt(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    except Exception:  # noqa: BLE001 - an estimate only: no estimate, no check
        return None
    return total + sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                       if isinstance(t, torch.Tensor) and t.device.type == "meta")
