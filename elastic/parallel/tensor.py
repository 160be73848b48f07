"""Tensor parallelism: each layer's weights split over the `tp` ranks of a replica's slot group,
with `torch.distributed.tensor.parallel` (DTensor's `parallelize_module`).

A job sets `train.tp.size` and, optionally, `train.tp.plan`: a function `(model, tp_mesh)` that
parallelizes the model in place (a pipeline passes it the rank's stage, an `nn.Sequential` of the
whole model's children under their own names). Without one, the built-in plan below applies the
Megatron-style split to every transformer block it recognises:

  * attention: a fused `qkv` Linear (or separate `q`, `k`, `v`) split column-wise, its output
    projection `proj` (or `o_proj`, `out_proj`) row-wise, so each tp rank computes whole heads;
  * MLP: an `mlp` (or `ffn`, `feed_forward`) `nn.Sequential` whose first Linear is split
    column-wise and last Linear row-wise.

A fused `qkv` must be laid out head-major (the output features of head h are its q, k and v, one
after another) and the block must take its local head count from the width it receives
(`view(b, t, -1, 3, head_dim)`), as `examples/gpt.py` does: a column split then gives each rank
whole heads. Everything the plan does not name (embeddings, norms, the head) stays a plain
tensor, replicated over tp. Every rank builds the whole model from the seed and keeps its slice,
so the values do not depend on the layout: the same seed gives the same weights at any tp.

Helpers here let the data-parallel code treat a DTensor parameter by its local tensor, and
`localize` gives data parallelism plain parameters, as torch's DDP does with tensor parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

NORMS = tuple(c for c in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if c is not None)
ATTENTION_IN = (("qkv",), ("q", "k", "v"), ("q_proj", "k_proj", "v_proj"))
ATTENTION_OUT = ("proj", "o_proj", "out_proj")
MLP = ("mlp", "ffn", "feed_forward")


class TensorPlanError(ValueError):
    """The model cannot be split as asked; the message names the setting."""


# ---------------------------------------------------------------- local views of DTensors
def is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard; a plain tensor itself)."""
    return t._local_tensor if is_dtensor(t) else t


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value` (this rank's local part) as a gradient for `param`: a DTensor with the parameter's
    layout where the parameter is one, else `value` viewed in the parameter's shape."""
    if not is_dtensor(param):
        return value.view_as(param)
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(value.view(param._local_tensor.shape), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def copies_in_slot_group(t: torch.Tensor, tp: int) -> int:
    """How many ranks of one replica's tp group hold each element of `t`: all `tp` unless `t` is
    a DTensor split over the mesh's "tp" axis, or a parameter `localize` made of one. (A plain
    tensor, or a parameter FSDP sharded over "dp" only, is the same on every rank of the tp group.)"""
    spec = getattr(t, "elastic_tp", None)
    mesh, placements = (spec.mesh, spec.placements) if spec else (getattr(t, "device_mesh", None), getattr(t, "placements", ()))
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" not in names:
        return tp
    return tp if placements[names.index("tp")].is_replicate() else 1


# ---------------------------------------------------------------- plain parameters for DDP x TP
@dataclass(frozen=True)
class TpSpec:
    """Where a localized parameter's tensor sits in the whole one (DTensor.from_local's arguments)."""
    mesh: object
    placements: tuple
    shape: torch.Size
    stride: tuple


def localize(model: nn.Module) -> nn.Module:
    """Every DTensor parameter becomes a plain `nn.Parameter` holding this rank's local tensor
    (the same storage), with its layout in `param.elastic_tp`; each module that owns one is given
    DTensor views of them for the length of its forward (a pre-hook) and its plain parameters back
    after it (a hook that runs on an exception too). What torch's DistributedDataParallel does to a
    tensor-parallel model (torch.distributed.tensor.parallel.ddp), for the same reason: outside
    forward the optimizer, the gradient buckets and the checkpoint see plain tensors, so an
    optimizer step costs what it costs without tensor parallelism (AdamW on DTensors took 2.4x the
    CPU, measured), and `foreach`/`fused` optimizers work, which refuse a mix of DTensors and
    tensors. Activation checkpointing's recomputation runs the hooks again. `as_dtensors` gives a
    state dict its DTensors back, so checkpoints still load at any layout by name."""
    for mod in model.modules():
        leaves = {}
        for name, p in list(mod._parameters.items()):
            if p is not None and is_dtensor(p):
                leaf = nn.Parameter(p._local_tensor.detach(), requires_grad=p.requires_grad)
                leaf.elastic_tp = TpSpec(p.device_mesh, tuple(p.placements), p.shape, p.stride())
                mod._parameters[name] = leaves[name] = leaf
        if leaves:
            mod.elastic_tp_leaves = leaves
            mod.register_forward_pre_hook(_dtensor_views)
            mod.register_forward_hook(_plain_again, always_call=True)
    return model


def _from_local(t: torch.Tensor, s: TpSpec):
    """`t` (this rank's part) viewed as the DTensor `s` describes: the same storage."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(t, s.mesh, s.placements, run_check=False, shape=s.shape, stride=s.stride)


def _dtensor_views(module: nn.Module, args) -> None:
    for name, leaf in module.elastic_tp_leaves.items():
        module._parameters[name] = _from_local(leaf, leaf.elastic_tp)  # through autograd: the gradient reaches the leaf


def _plain_again(module: nn.Module, args, output) -> None:
    module._parameters.update(module.elastic_tp_leaves)


def as_dtensors(model: nn.Module, state: dict) -> dict:
    """`state` ({"model", "optim"} by fully-qualified name, as DCP's get_state_dict gives it) with
    every tensor of a localized parameter (its value, and each optimizer state of its shape)
    viewed as the DTensor it is a part of: the same storage, so loading into it loads the model."""
    specs = {n: p for n, p in model.named_parameters() if hasattr(p, "elastic_tp")}
    if not specs:
        return state
    out = {**state, "model": dict(state["model"]), "optim": {**state["optim"], "state": dict(state["optim"]["state"])}}
    for name, p in specs.items():
        if name in out["model"]:
            out["model"][name] = _from_local(out["model"][name].detach(), p.elastic_tp)
        per = out["optim"]["state"].get(name)
        if per is not None:
            out["optim"]["state"][name] = {k: _from_local(v.detach(), p.elastic_tp) if isinstance(v, torch.Tensor)
                                           and v.shape == p.shape else v for k, v in per.items()}
    return out


def as_locals(state: dict) -> dict:
    """`as_dtensors` undone: each DTensor of `state` replaced by its local tensor (the same storage)."""
    from elastic.parallel.resharding import map_leaves
    return map_leaves(state, lambda v: local(v) if is_dtensor(v) else v)


# ---------------------------------------------------------------- the built-in plan
def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    m = getattr(module, name, None)
    return m if isinstance(m, nn.Linear) else None


def block_plan(module: nn.Module) -> dict[str, str]:
    """For one module: child name -> "colwise" | "rowwise", if it is a block the built-in plan
    recognises (attention, MLP, or both), else {}."""
    plan: dict[str, str] = {}
    for names in ATTENTION_IN:
        if all(_linear(module, n) for n in names):
            out = next((n for n in ATTENTION_OUT if _linear(module, n)), None)
            if out is not None:
                plan.update({n: "colwise" for n in names})
                plan[out] = "rowwise"
            break
    for name in MLP:
        mlp = getattr(module, name, None)
        if isinstance(mlp, nn.Sequential):
            lin = [n for n, c in mlp.named_children() if isinstance(c, nn.Linear)]
            if len(lin) >= 2:
                plan[f"{name}.{lin[0]}"] = "colwise"
                plan[f"{name}.{lin[-1]}"] = "rowwise"
            break
    return plan


def builtin_plans(model: nn.Module) -> dict[str, dict[str, str]]:
    """Every recognised block of `model`: its name -> its plan (block_plan)."""
    out = {}
    for name, m in model.named_modules():
        plan = block_plan(m)
        if plan:
            out[name] = plan
    return out


def _norms(block: nn.Module) -> list[str]:
    return [n for n, c in block.named_children() if isinstance(c, NORMS)]


def check_builtin(model: nn.Module, tp: int, sequence_parallel: bool = False) -> None:
    """Before any worker starts (on the meta device): the built-in plan finds blocks, and tp
    divides every split width and each block's head count (`heads` / `n_heads` / `num_heads`).
    With sequence parallelism, every block holds its own norms and no block sits inside another."""
    plans = builtin_plans(model)
    if not plans:
        raise TensorPlanError(
            f"train.tp.size={tp}: the built-in plan found no block to split (it looks for a `qkv` Linear, or "
            f"`q`/`k`/`v`, with a `proj` Linear, and an `mlp` nn.Sequential of Linears). Set train.tp.plan: "
            f"module:function(model, tp_mesh) that parallelizes the model (torch.distributed.tensor.parallel)")
    for name, plan in plans.items():
        block = model.get_submodule(name)
        heads = next((getattr(block, a) for a in ("heads", "n_heads", "num_heads") if isinstance(getattr(block, a, None), int)), None)
        if heads is not None and heads % tp:
            raise TensorPlanError(f"train.tp.size={tp} does not divide the {heads} attention heads of {name or '(root)'}: "
                                  f"each tp rank must hold whole heads. Choose a tp size that divides {heads}")
        for child, style in plan.items():
            lin = block.get_submodule(child)
            width, field = (lin.out_features, "output") if style == "colwise" else (lin.in_features, "input")
            if width % tp:
                raise TensorPlanError(f"train.tp.size={tp} does not divide the {width} {field} features of "
                                      f"{name}.{child}, which the built-in plan splits {style}. Choose a tp size "
                                      f"that divides {width}")
    if sequence_parallel:
        for name in plans:
            inner = [o for o in plans if o != name and o.startswith(f"{name}." if name else "")]
            if inner:
                raise TensorPlanError(f"train.tp.sequence_parallel: the built-in plan found the block {inner[0]} inside "
                                      f"the block {name or '(root)'}; it splits the sequence between blocks that run "
                                      f"one after another. Give each block its attention and MLP, or set train.tp.plan")
            if not _norms(model.get_submodule(name)):
                raise TensorPlanError(f"train.tp.sequence_parallel: the block {name or '(root)'} holds no LayerNorm or "
                                      f"RMSNorm of its own, which sequence parallelism splits along the sequence. "
                                      f"Leave sequence_parallel off, or set train.tp.plan")


def apply_builtin(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    """The built-in plan. With `sequence_parallel` (torchtitan's layout), inside the blocks the
    residual stream and the norms hold 1/tp of the sequence each: a column-wise Linear gathers its
    input, a row-wise one reduce-scatters its output, the first block takes its part of the whole
    sequence it gets and the last block gathers it back, so what runs between blocks (embeddings,
    head) sees the whole sequence as without it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    into, out_of = ({"input_layouts": Shard(1)}, {"output_layouts": Shard(1)}) if sequence_parallel else ({}, {})
    plans = builtin_plans(model)
    for i, (name, plan) in enumerate(plans.items()):
        block = model.get_submodule(name)
        styles = {c: ColwiseParallel(**into) if s == "colwise" else RowwiseParallel(**out_of) for c, s in plan.items()}
        if sequence_parallel:
            styles.update({n: SequenceParallel(use_local_output=True) for n in _norms(block)})
        parallelize_module(block, tp_mesh, styles)
        if sequence_parallel and i == 0:
            block.register_forward_pre_hook(_SequenceParts(tp_mesh))
        if sequence_parallel and i == len(plans) - 1:  # the parts gathered into the whole sequence
            parallelize_module(block, tp_mesh, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                                                   use_local_output=True))
    return model


class _SequenceParts:
    """Forward pre-hook of the first block: its input (the whole sequence, the same on every tp
    rank) becomes this rank's part of the sequence; in backward the parts' gradients are gathered.
    (torch's PrepareModuleInput would need a layout for each of the block's arguments; this takes
    the first, and checks that the sequence divides.)"""

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, module, args):
        from torch.distributed.tensor import DTensor, Replicate, Shard
        x, tp = args[0], self.mesh.size()
        if x.dim() < 2 or x.shape[1] % tp:
            raise ValueError(f"train.tp.sequence_parallel: the blocks' input has shape {tuple(x.shape)}; its sequence "
                             f"(dimension 1) must divide into train.tp.size={tp} equal parts. Choose a sequence length "
                             f"that {tp} divides, or leave sequence_parallel off")
        part = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(self.mesh, [Shard(1)])
        return (part.to_local(), *args[1:])


def apply(model: nn.Module, tp_mesh, plan_fn=None, sequence_parallel: bool = False) -> nn.Module:
    """Parallelize `model` over `tp_mesh` with the user's plan, else the built-in one."""
    if plan_fn is None:
        return apply_builtin(model, tp_mesh, sequence_parallel)
    out = plan_fn(model, tp_mesh)
    return model if out is None else out


def import_plan(ref):
    """train.tp.plan's function: a 'module:function' imported, or the object given from Python."""
    from elastic.config.train import resolve_ref
    return resolve_ref(ref, "train.tp.plan")
