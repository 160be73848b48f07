"""Parallelism strategies: how a model is wrapped, how gradients meet, what a state dict is.

Strategies know nothing about failures; the worker and controller own that.
"""
from elastic.parallel.base import Strategy
from elastic.parallel.ddp import DataParallel
from elastic.parallel.fsdp import FullyShardedDataParallel
from elastic.parallel.pipeline import Pipeline

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DataParallel, "fsdp": FullyShardedDataParallel,
                                         "pipeline": Pipeline}


def make_strategy(spec, mesh, layout, rank: int, seed: int = 0) -> Strategy:
    """`spec`: the job's TrainSpec (its `strategy` picks the class); `layout`: the rank's mesh;
    `seed`: the run's (PowerSGD's first factors are drawn from it)."""
    if spec.strategy == "pipeline":
        return Pipeline(mesh, spec, layout, rank)
    if spec.strategy == "ddp":
        return DataParallel(mesh, spec, seed)
    return STRATEGIES[spec.strategy](mesh, spec)

