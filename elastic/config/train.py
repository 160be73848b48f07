"""What to train (the job's `train` section): the user's callables, the strategy and its settings,
the data, precision and bad-step handling."""
from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable, Literal

from pydantic import Field, model_validator

from elastic.config import evaluation
from elastic.config.base import Strict
from elastic.config.compression import GradCompressionSpec, check_applies
from elastic.config.objects import Ref, UserObject


def import_ref(ref: str, field: str) -> Callable:
    if not isinstance(ref, str) or ref.count(":") != 1:
        raise ValueError(f"{field}: expected 'module:function', got {ref!r}")
    mod_name, fn_name = ref.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
        raise ValueError(f"{field}: cannot import module {mod_name!r} ({type(e).__name__}: {e}); "
                         f"is it on PYTHONPATH / in the job's working dir?") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{field}: module {mod_name!r} has no callable {fn_name!r}")
    return fn


def resolve_ref(ref: str | UserObject, field: str) -> Callable:
    """The callable a job's `field` names: a 'module:function' imported, or the object given."""
    return ref.get() if isinstance(ref, UserObject) else import_ref(ref, field)


def _check_object(ref, field: str, what: str) -> None:
    """An object given for `field` (from Python) is something it can call; said before any worker
    starts. (A string is checked where it is imported.)"""
    if not isinstance(ref, UserObject) or not ref.local:
        return
    obj = ref.get()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        raise ValueError(f"{field}: got a model ({ref}), not {what}: elastic calls it on every "
                         f"worker (under train.meta_init on the meta device); pass the function or "
                         f"class that builds it")
    if not callable(obj):
        raise ValueError(f"{field}: expected {what}, got {ref}, which cannot be called")


def _dataset_factory(ref: str | UserObject, field: str = "train.dataset") -> Callable:
    """train.dataset as a function: one given as the dataset itself (map-style: len, getitem)
    is returned by a function."""
    got = resolve_ref(ref, field)
    if not callable(got) and hasattr(got, "__len__") and hasattr(got, "__getitem__"):
        return functools.partial(_same, got)
    return got


def _same(obj):
    return obj


DTYPES = Literal["float32", "bfloat16", "float16"]


class FsdpSpec(Strict):
    """Settings of the fully-sharded strategy (train.strategy: fsdp), PyTorch's fully_shard (FSDP2)."""

    blocks: list[str] | None = Field(
        None, description="Class names of the submodules sharded as one unit each (e.g. [TransformerBlock]); "
                          "default: every element of every nn.ModuleList, else every child of an "
                          "nn.Sequential root that has parameters. The root is always sharded last. Checked "
                          "on the meta device before any worker starts.")
    reshard_after_forward: bool = Field(
        True, description="Free gathered parameters after forward (ZeRO-3); false keeps them until backward.")
    param_dtype: DTYPES = Field("float32", description="Dtype of gathered parameters in forward/backward (GPU only).")
    reduce_dtype: DTYPES = Field("float32", description="Dtype of the gradient reduce-scatter (GPU only).")
    replicate: int = Field(
        1, ge=1, description="HSDP: replica groups at scaling.num_workers. Each group shards the state over "
                             "num_workers / replicate ranks (FSDP2 on a 2-D mesh; with train.tp.size, each tp slice "
                             "over num_workers / (replicate x tp) ranks, a 3-D mesh); gradients are reduce-scattered "
                             "within a group and all-reduced across groups. A lost rank is restored from its peer "
                             "at the same shard (and tp index) in another group's memory; the run grows and shrinks "
                             "by whole groups. 1: plain FSDP.")
    offload: bool = Field(
        False, description="CPU offload (FSDP2's CPUOffloadPolicy): the sharded parameters, their gradients and the "
                           "optimizer state live in host memory (pinned on a GPU), each block's parameters are "
                           "copied to the device for its all-gather, and the optimizer steps on the CPU. Device "
                           "memory then holds activations and one gathered block at a time. On a CPU-only run it "
                           "changes nothing but FSDP's code path. Not with train.precision: fp16 or train.meta_init (yet).")


SCHEDULES = Literal["gpipe", "1f1b", "interleaved_1f1b"]


class PipelineSpec(Strict):
    """Settings of the pipeline strategy (train.strategy: pipeline): the model is cut into stages at
    the children of its nn.Sequential root, one stage per rank (two or more with interleaved_1f1b),
    and torch.distributed.pipelining runs the schedule. scaling.num_workers = stages x replicas."""

    stages: int = Field(ge=1, description="Pipeline stages (ranks per pipeline replica).")
    schedule: SCHEDULES = Field("1f1b", description="gpipe | 1f1b | interleaved_1f1b (torch.distributed.pipelining).")
    microbatches: int = Field(ge=1, description="Micro-batches per replica per step; they split the replica's share "
                                                "of the global batch evenly; the global batch must split into replicas x "
                                                "microbatches for every layout the run may take.")
    stages_per_rank: int | None = Field(
        None, ge=1, description="Model chunks per rank (interleaved_1f1b only; default 2 there, 1 otherwise).")
    split: list[str] | None = Field(
        None, description="Names of the root's children where stages 2, 3, ... begin (one fewer than the number of "
                          "chunks); default: balanced by parameter count.")
    loss: Ref = Field(description="module:function(output, target) -> scalar loss, mean over the micro-batch; "
                                  "the last stage calls it with its output and the batch's last element.")

    @property
    def chunks_per_rank(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule == "interleaved_1f1b" else 1

    @model_validator(mode="after")
    def _check_schedule(self) -> "PipelineSpec":
        if self.stages_per_rank not in (None, 1) and self.schedule != "interleaved_1f1b":
            raise ValueError(f"stages_per_rank={self.stages_per_rank} needs schedule: interleaved_1f1b "
                             f"(gpipe and 1f1b run one stage per rank)")
        if self.schedule == "interleaved_1f1b" and self.chunks_per_rank < 2:
            raise ValueError("schedule interleaved_1f1b needs stages_per_rank >= 2")
        return self


class TensorParallelSpec(Strict):
    """Tensor parallelism (train.tp): every stage's layers split over `size` ranks
    (torch.distributed.tensor.parallel). scaling.num_workers = replicas x stages x size."""

    size: int = Field(1, ge=1, description="Ranks each layer is split over (1: no tensor parallelism). Fixed "
                                           "for the run: the world grows and shrinks by whole replicas.")
    plan: Ref | None = Field(
        None, description="module:function(model, tp_mesh) that parallelizes the model in place with "
                          "torch.distributed.tensor.parallel (a pipeline passes the rank's stage). Default: the "
                          "built-in Megatron-style plan for transformer blocks (a head-major fused `qkv` or "
                          "`q`/`k`/`v` column-wise, `proj` row-wise, an `mlp`'s first Linear column-wise and last "
                          "row-wise; docs/large-models.md). Checked on the meta device before any worker starts.")
    regroup: bool = Field(
        True, description="When a tp group's ranks span nodes (a straggler's spare or a replacement found no room "
                          "beside the group), a refilled spare starts on the node holding most of the group and, "
                          "once warm (and, with stragglers on, calibrated within their threshold), the rank off "
                          "that node moves to it at a step boundary: a planned swap, its state from memory. "
                          "Where replicas of a slot hold the same state (not fsdp), two split groups first trade "
                          "ranks of one slot instead (a renumbering at a step boundary, nothing moved).")
    sequence_parallel: bool = Field(
        False, description="With the built-in plan: also split the norms and the residual stream inside the blocks "
                           "along the sequence (Megatron's sequence parallelism), so those activations cost 1/size "
                           "per rank; the attention and MLP inputs are gathered, their outputs reduce-scattered. "
                           "The blocks must run one after another on the residual stream and each hold its own "
                           "norms (examples/gpt.py). A train.tp.plan applies SequenceParallel itself.")


class DataSpec(Strict):
    """A built-in dataset (train.data), instead of a dataset function."""

    format: Literal["parquet"] = Field(description="parquet: rows of Parquet files, by global index.")
    uri: str = Field(description="fsspec URI of the files: one file, a folder, or a glob (s3://bucket/corpus/*.parquet).")
    columns: list[str] | None = Field(None, description="Columns, in the order each sample's tuple has them; default all.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="Passed to fsspec, as checkpoint.storage_options is (credentials: "
                                          "from the environment, as there).")

    def factory(self) -> Callable:
        return functools.partial(_parquet_dataset, self.uri, self.columns, self.storage_options)


def _parquet_dataset(uri: str, columns, storage_options):
    from elastic.data.parquet import ParquetDataset  # pyarrow: imported only by jobs that read Parquet
    return ParquetDataset(uri, columns, storage_options)


class TrainSpec(Strict):
    """What to train. Each callable is given as 'module:function' so workers can import it, or, from
    Python (Trainer), as the function or object itself, which travels to the workers pickled by
    cloudpickle (docs/getting-started.md#objects-instead-of-names)."""

    model: Ref = Field(description="module:function() -> torch.nn.Module")
    dataset: Ref | None = Field(
        None, description="module:function() -> map-style dataset (len, getitem); from Python, "
                          "the dataset itself too")
    data: DataSpec | None = Field(None, description="A built-in dataset ({format: parquet, uri, columns}) instead of "
                                                    "train.dataset.")
    loss: Ref | None = Field(None, description="module:function(model, batch) -> scalar loss, mean over the batch "
                                              "(ddp, fsdp; a pipeline uses train.pipeline.loss), or (loss, "
                                              "{name: scalar tensor}) to log metrics of your own "
                                              "(docs/getting-started.md#your-own-metrics)")
    optimizer: Ref | None = Field(None, description="module:function(params) -> optimizer; default AdamW(lr=1e-3)")
    global_batch_size: int = Field(ge=1, description="Samples per optimizer step, constant for the run.")
    micro_batch_size: int | None = Field(
        None, ge=1, description="Samples per forward/backward on one rank; default: the whole per-rank share."
    )
    strategy: Literal["ddp", "fsdp", "pipeline"] = Field(
        "ddp", description="ddp: every rank holds the whole model; fsdp: parameters, gradients and optimizer "
                           "state sharded across ranks (re-sharded on every resize); pipeline: the model cut "
                           "into stages, one per rank, with data-parallel replicas of the whole pipeline.")
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec, description="Used when strategy is fsdp.")
    pipeline: PipelineSpec | None = Field(None, description="Required when strategy is pipeline.")
    tp: TensorParallelSpec = Field(default_factory=TensorParallelSpec,
                                   description="Tensor parallelism, with any strategy (docs/large-models.md).")
    grad_compression: GradCompressionSpec = Field(
        default_factory=GradCompressionSpec,
        description="Compress ddp's gradient all-reduce: none | bf16 | powersgd | topk, or a "
                    "mapping with its settings (docs/grad-compression.md).")
    meta_init: bool = Field(
        False, description="Build the model on the meta device (no memory); each rank then allocates and initialises "
                           "only its own part (stage, tensor slice, FSDP shard), one module at a time from the run's "
                           "seed and the module's name, so the weights do not depend on the layout. Each module with "
                           "tensors of its own is initialised by its reset_parameters(), or by train.init. "
                           "docs/large-models.md.")
    init: Ref | None = Field(
        None, description="With train.meta_init: module:function(name, module) that initialises one module's own "
                          "parameters and buffers in place (a full-size copy on the CPU, its children not included), "
                          "instead of module.reset_parameters(). Seeded per module: draw from torch's global RNG.")
    init_from: str | None = Field(
        None, description="Pretrained weights, loaded over the built model when the run starts "
                          "fresh (a resumed run restores its own checkpoint): a torch state dict "
                          "(.pt, .pth, .bin), a safetensors file (.safetensors; pip install "
                          "'elastic-trainer[safetensors]') or another run's checkpoint (its run "
                          "folder, or one step folder); a path or URI, read with "
                          "checkpoint.storage_options. Names are the model's own "
                          "(model.state_dict()'s); any layout. Each rank reads only its part where "
                          "the source allows (docs/models.md).")
    init_strict: bool = Field(
        True, description="With train.init_from: the source's names and the model's must be the "
                          "same, else the run is refused before it starts, naming them. false: load "
                          "what matches; the rest keeps its init (both lists are logged by name). "
                          "Shapes must match either way.")
    activation_checkpointing: list[str] | None = Field(
        None, description="Class names of the blocks whose activations are recomputed in backward instead of kept "
                          "(torch.utils.checkpoint, non-reentrant, one block at a time; e.g. [Block]). Checked on "
                          "the meta device before any worker starts. Default: none.")
    scheduler: Ref | None = Field(
        None, description="module:function(optimizer) -> torch LRScheduler, stepped once per training step; its state "
                          "is a function of the step, replayed on every restore. ReduceLROnPlateau is "
                          "refused (it follows a metric).")
    clip_grad_norm: float | None = Field(
        None, gt=0, description="Clip gradients to this global L2 norm (over every rank's parameters: replicas, "
                                "shards and stages alike).")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="fp32; bf16 (autocast, CPU and GPU); fp16 (autocast with dynamic loss scaling: start "
                            "2^16, halved on overflow, doubled after 2000 good steps; the scale is saved and "
                            "restored with the state). On GPU, FSDP's parameter and reduce dtypes follow it unless "
                            "train.fsdp sets them.")
    deterministic: bool = Field(
        False, description="Deterministic kernels on every rank: torch.use_deterministic_algorithms(True) (an op "
                           "with no deterministic implementation then raises, naming itself), cuDNN's deterministic "
                           "algorithms without benchmarking, and on GPU CUBLAS_WORKSPACE_CONFIG=:4096:8 (unless "
                           "already :4096:8 or :16:8), set before CUDA starts. Costs speed on GPU; the CPU runs of the "
                           "chaos tests repeat bit for bit without it.")
    bad_step: Literal["raise", "skip", "rollback"] = Field(
        "raise", description="A step whose loss (or, with clipping or fp16, gradient norm) is not finite on any rank: "
                             "raise: stop with an error naming the step; skip: no update on any rank (the samples are "
                             "marked skipped); rollback: skip, and after bad_step_limit in a row return to the newest "
                             "committed checkpoint that holds the last good step's weights (one taken during the bad "
                             "run qualifies) and train on from there, skipping only the bad batches. Skipped "
                             "steps are step_skipped events and marked in the sample ledger.")
    prefetch: bool = Field(
        False, description="Collate the next step's batches on a background thread while this step computes (same "
                           "samples, same order). Leave off if the dataset draws from torch's global RNG: a draw on "
                           "another thread would make runs irreproducible.")
    data_workers: int = Field(
        0, ge=0, description="DataLoader worker processes per rank that read and collate the rank's upcoming batches "
                             "while it trains (same samples, same order; pinned memory on GPU). They use CPU beyond "
                             "scaling.cpus_per_worker. 0: the rank reads each batch when it needs it.")
    data_prefetch_factor: int = Field(
        2, ge=1, description="With data_workers: batches each data worker reads ahead (DataLoader prefetch_factor).")
    data_workers_start: Literal["forkserver", "spawn", "fork"] = Field(
        "forkserver", description="How data workers start. forkserver and spawn pickle the dataset to them (as "
                                  "Ray's docs advise inside Ray workers; a dataset that does not pickle is refused "
                                  "before any worker starts); fork copies the rank's process.")
    bad_step_limit: int = Field(3, ge=1, description="Bad steps in a row that end a skip (error) or trigger a rollback.")
    eval_dataset: Ref | None = evaluation.EVAL_DATASET
    eval_every_steps: int | None = evaluation.EVAL_EVERY_STEPS
    eval_batch_size: int | None = evaluation.EVAL_BATCH_SIZE
    eval_metrics: Ref | None = evaluation.EVAL_METRICS

    @model_validator(mode="after")
    def _check_strategy(self) -> "TrainSpec":
        if self.strategy == "pipeline" and self.pipeline is None:
            raise ValueError("train.strategy=pipeline needs train.pipeline: {stages, microbatches, loss}")
        if self.strategy != "pipeline" and self.pipeline is not None:
            raise ValueError(f"train.pipeline is set but train.strategy={self.strategy}: set train.strategy: pipeline")
        if (self.dataset is None) == (self.data is None):
            raise ValueError("set exactly one of train.dataset (module:function) and train.data ({format: parquet, "
                             "uri, columns})")
        if self.strategy != "pipeline" and self.loss is None:
            raise ValueError(f"train.loss is required with train.strategy={self.strategy}")
        if self.strategy == "pipeline" and self.micro_batch_size is not None:
            raise ValueError("train.micro_batch_size is not used by a pipeline: set train.pipeline.microbatches")
        check_applies(self.grad_compression, self.strategy, self.tp.size)
        if self.init is not None and not self.meta_init:
            raise ValueError("train.init is set but train.meta_init is false: set train.meta_init: true (an eager "
                             "build initialises the model in its own constructor)")
        for field, what in (("model", "a function that builds the model"),
                            ("loss", "a function(model, batch)"),
                            ("optimizer", "a function(params) -> optimizer"),
                            ("scheduler", "a function(optimizer) -> scheduler"),
                            ("init", "a function(name, module)"),
                            ("eval_metrics", "a function(model, batch) -> {name: sum}")):
            _check_object(getattr(self, field), f"train.{field}", what)
        if isinstance(self.dataset, UserObject) and self.dataset.local:
            ds = self.dataset.get()
            if not callable(ds) and not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
                raise ValueError(f"train.dataset: expected a map-style dataset (len, getitem) or a "
                                 f"function that returns one, got {self.dataset}")
        evaluation.check(self)
        if not self.init_strict and self.init_from is None:
            raise ValueError("train.init_strict is set but train.init_from is not: it says how "
                             "init_from loads")
        if self.prefetch and self.data_workers:
            raise ValueError(f"train.prefetch (a thread) and train.data_workers={self.data_workers} (processes) both "
                             "read ahead: set one of them")
        return self

    @property
    def dataset_ref(self) -> str:
        """How the job names its data, for messages."""
        return str(self.dataset) if self.dataset else f"train.data ({self.data.format} at {self.data.uri})"

    def resolve(self) -> dict[str, Callable | None]:
        """Import every callable; raises ValueError naming the field that fails."""
        return {
            "model": resolve_ref(self.model, "train.model"),
            "dataset": _dataset_factory(self.dataset) if self.dataset else self.data.factory(),
            "loss": resolve_ref(self.loss, "train.loss") if self.loss else None,
            "stage_loss": resolve_ref(self.pipeline.loss, "train.pipeline.loss") if self.pipeline else None,
            "tp_plan": resolve_ref(self.tp.plan, "train.tp.plan") if self.tp.plan else None,
            "init": resolve_ref(self.init, "train.init") if self.init else None,
            "scheduler": resolve_ref(self.scheduler, "train.scheduler") if self.scheduler else None,
            "optimizer": resolve_ref(self.optimizer, "train.optimizer") if self.optimizer else None,
            **evaluation.resolve(self, resolve_ref, _dataset_factory),
        }
