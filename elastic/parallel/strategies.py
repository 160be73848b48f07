"""Parallelism strategies: how a model is wrapped, how gradients meet, what a state dict is.

Strategies know nothing about failures; the worker and controller own that.
"""
from elastic.parallel.base import Strategy
from elastic.parallel.ddp import DataParallel
from elastic.parallel.fsdp import FullyShardedDataParallel
from elastic.parallel.pipeline import Pipeline

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DataParallel, "fsdp": FullyShardedDataParallel,
                                         "pipeline": Pipeline}


def make_strategy(spec, mesh, layout, rank: int) -> Strategy:
    """`spec`: the job's TrainSpec (its `strategy` picks the class); `layout`: the rank's mesh."""
    if spec.strategy == "pipeline":
        return Pipeline(mesh, spec, layout, rank)
    return STRATEGIES[spec.strategy](mesh, spec)

