"""The evaluation settings of the job's `train` section (train.eval_*): their fields, the checks
that refuse a job before any worker starts, and the callables they name. The evaluation itself
runs on the workers (elastic/runtime/evaluation.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from pydantic import Field

if TYPE_CHECKING:
    from elastic.config.train import TrainSpec

EVAL_DATASET = Field(None, description=(
    "module:function() -> map-style dataset to evaluate on (from Python, the dataset itself too), "
    "as train.dataset. Each sample is evaluated exactly once per evaluation, sharded over the "
    "ranks; the numbers do not depend on the world size (docs/getting-started.md#evaluation). ddp "
    "and fsdp only."))
EVAL_EVERY_STEPS = Field(None, ge=1, description=(
    "With train.eval_dataset: evaluate after every step whose number is a multiple of this; the "
    "last step is always evaluated. Default: the last step only."))
EVAL_BATCH_SIZE = Field(None, ge=1, description=(
    "With train.eval_dataset: samples per forward of an evaluation (the last batch may be "
    "shorter). Batches are cut from the evaluation set the same way at any world size. Default: "
    "train.micro_batch_size, else train.global_batch_size."))
EVAL_METRICS = Field(None, description=(
    "With train.eval_dataset: module:function(model, batch) -> {name: tensor}, each value the SUM "
    "over the batch's samples (or a pair (sum, count) for a mean over something else, e.g. "
    "tokens); reported as the total over the evaluation set divided by its number of samples (or "
    "the summed counts). Default: {'loss': train.loss(model, batch) x the batch's size}."))

NAMES = ("eval_every_steps", "eval_batch_size", "eval_metrics")


def check(tr: TrainSpec) -> None:
    """Refuse an evaluation the run cannot do, naming the field and what to do."""
    if tr.eval_dataset is None:
        given = [n for n in NAMES if getattr(tr, n) is not None]
        if given:
            raise ValueError(f"train.{given[0]} is set but train.eval_dataset is not: set "
                             f"train.eval_dataset (module:function) or remove train.{given[0]}")
        return
    # A pipeline's stages and a tp group see one batch between several ranks: the sharding and
    # the reduction here count each sample once per data-parallel rank, which they are not.
    if tr.strategy == "pipeline":
        raise ValueError("train.eval_dataset is not supported with train.strategy=pipeline: use "
                         "ddp or fsdp, or evaluate a checkpoint separately "
                         "(docs/getting-started.md#evaluation)")
    if tr.tp.size > 1:
        raise ValueError(f"train.eval_dataset is not supported with train.tp.size={tr.tp.size}: "
                         f"set train.tp.size: 1, or evaluate a checkpoint separately "
                         f"(docs/getting-started.md#evaluation)")
    if tr.eval_metrics is None and tr.loss is None:
        raise ValueError("train.eval_dataset needs train.eval_metrics or train.loss")


def batch_size(tr: TrainSpec) -> int:
    return tr.eval_batch_size or tr.micro_batch_size or tr.global_batch_size


def resolve(tr: TrainSpec, resolve_ref: Callable, dataset_factory: Callable) -> dict:
    """The evaluation's callables: its dataset factory and its metrics function (None: none)."""
    if tr.eval_dataset is None:
        return {"eval_dataset": None, "eval_metrics": None}
    return {"eval_dataset": dataset_factory(tr.eval_dataset, "train.eval_dataset"),
            "eval_metrics": (resolve_ref(tr.eval_metrics, "train.eval_metrics")
                             if tr.eval_metrics is not None else None)}
