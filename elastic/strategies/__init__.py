"""Parallelism strategies: how a model is wrapped, how gradients meet, what a state dict is.

Strategies know nothing about failures; the worker and controller own that.
"""
from elastic.strategies.base import Strategy
from elastic.strategies.ddp import DataParallel

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DataParallel}


def make_strategy(name: str, mesh) -> Strategy:
    return STRATEGIES[name](mesh)
