"""FSDP for the Ray Train peer (`benchmarks/ray_train_peer.py`, `--strategy fsdp`), the way a Ray
Train user who wants it to win writes it: plain FSDP2 (`fully_shard`) in the training function,
each layer of the MLP sharded and then the root (what elastic's fsdp does with the same model),
and Ray Train's distributed checkpointing: every worker saves its own shards with
`torch.distributed.checkpoint` into its own directory and reports it, and Ray Train merges the
workers' files into one checkpoint in storage (ray.train.report: "Checkpoints from multiple
workers will be merged into one directory"). On restart each worker reads the merged checkpoint
back, re-sharded by DCP for the group it is in.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

STEP_FILE = "step.json"
# Pipeline stages: the optimizer's state by parameter name, as torchtitan saves it. Unflattened,
# each stage's param_groups are saved by position ("param_groups.0"), the same keys on every
# stage: DCP keeps one stage's, and the other stage's optimizer loads without its learning rate
# and betas (measured: AdamW then fails its next step with KeyError 'betas').
PIPELINE = StateDictOptions(flatten_optimizer_state_dict=True)


def shard(model: nn.Module, world_size: int, use_gpu: bool) -> nn.Module:
    """FSDP2 over every rank: each child with parameters a unit, then the root."""
    mesh = init_device_mesh("cuda" if use_gpu else "cpu", (world_size,))
    if use_gpu:
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def save(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, directory: str, rank: int,
         options: StateDictOptions | None = None) -> None:
    """This rank's shards of model and optimizer (collective: every rank calls it at the same step).
    `options`: `PIPELINE` where ranks hold different modules (pipeline stages)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    if rank == 0:
        with open(os.path.join(directory, STEP_FILE), "w") as f:
            json.dump({"step": step}, f)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str,
         options: StateDictOptions | None = None) -> int:
    """The merged checkpoint into this rank's shards; returns its step. `options` as saved."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    with open(os.path.join(directory, STEP_FILE)) as f:
        return int(json.load(f)["step"])
