"""The strategy interface shared by DDP (and, later, FSDP and pipeline stages)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


class Strategy(ABC):
    name = "base"

    def __init__(self, mesh):
        self.mesh = mesh  # a DeviceMesh with named axes; "dp" for data parallel

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    @abstractmethod
    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, src_rank: int) -> None:
        """Make every rank's model (and optimizer, unless None) state equal to `src_rank`'s."""

    @abstractmethod
    def reduce_gradients(self, model: nn.Module, grad_scale: float) -> None:
        """Combine gradients across the `dp` axis and scale them; after this, every rank steps."""

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Model and optimizer state keyed by fully-qualified names, as DCP saves it."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
