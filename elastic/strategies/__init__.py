"""Parallelism strategies: how a model is wrapped, how gradients meet, what a state dict is.

Strategies know nothing about failures; the worker and controller own that.
"""
from elastic.strategies.base import Strategy
from elastic.strategies.ddp import DataParallel
from elastic.strategies.fsdp import FullyShardedDataParallel

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DataParallel, "fsdp": FullyShardedDataParallel}


def make_strategy(spec, mesh) -> Strategy:
    """`spec`: the job's TrainSpec (its `strategy` picks the class)."""
    return STRATEGIES[spec.strategy](mesh, spec)
