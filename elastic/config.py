"""User settings: pydantic models for every knob, YAML in, clear errors out.

Every model forbids unknown keys, so a typo in `job.yaml` is an error that
names the key instead of a silently ignored setting. Cross-field checks that
need the whole job (batch plan vs. world size) live in `JobConfig`.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScalingConfig(_Strict):
    num_workers: int = Field(2, ge=1, description="Training ranks (one Ray actor each); the target size.")
    min_workers: int | None = Field(
        None, ge=1, description="Shrink down to this many ranks when lost ones cannot be replaced; default num_workers.")
    max_workers: int | None = Field(
        None, ge=1, description="Grow up to this many ranks when capacity appears; default num_workers.")
    shrink_after_s: float = Field(
        10.0, ge=0, description="How long a recovery waits for a replacement before shrinking (min_workers < size).")
    grow_check_s: float = Field(10.0, gt=0, description="How often a run below max_workers looks for capacity.")
    num_spares: int = Field(
        0, ge=0, description="Warm spare workers (model built, ready to receive state) that replace lost or slow ranks.")
    wait_for_spares: bool = Field(
        False, description="Start training only once the spares are warm (drills and benchmarks of the spare path).")
    low_priority_refills: bool = Field(
        True, description="Spares that refill the pool while the group trains start under SCHED_IDLE (the lowest CPU "
                          "priority) until built, where the OS lets them return to normal (elastic/priority.py).")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs reserved per worker actor.")
    use_gpu: bool = Field(False, description="One GPU per worker and NCCL; gloo on CPU otherwise.")


    @model_validator(mode="after")
    def _check_range(self) -> "ScalingConfig":
        lo, hi = self.min_size, self.max_size
        if not lo <= self.num_workers <= hi:
            raise ValueError(f"scaling: need min_workers <= num_workers <= max_workers, got {lo} <= "
                             f"{self.num_workers} <= {hi}")
        return self

    @property
    def min_size(self) -> int:
        return self.min_workers if self.min_workers is not None else self.num_workers

    @property
    def max_size(self) -> int:
        return self.max_workers if self.max_workers is not None else self.num_workers


class FailureConfig(_Strict):
    max_failures: int = Field(3, ge=0, description="Recoveries allowed before the run stops with an error.")
    peer_restore: bool = Field(
        True, description="Recover state from a surviving replica's memory when one exists; false: always from storage.")
    hang_factor: float = Field(
        10.0, gt=1, description="A hang is no progress for hang_factor x the median step time..."
    )
    hang_floor_s: float = Field(20.0, gt=0, description="...but never less than this many seconds.")
    ping_timeout_s: float = Field(
        1.0, gt=0, description="A rank that answers no poll for this long while the group makes no progress is "
                               "lost (a stopped machine, a partition, a stopped process); its peers' blocked "
                               "collectives are then aborted and they keep their state.")
    silence_factor: float = Field(
        2.0, gt=0, description="...and only once the group has made no progress for silence_factor x the median "
                               "step time, when that is longer than ping_timeout_s: a rank busy in a long step "
                               "(a large model, a checkpoint's first snapshot) may answer a poll late without "
                               "being lost.")
    heartbeat: bool = Field(
        True, description="Run a small heartbeat process beside each worker that answers the controller over UDP "
                          "with the worker process's state, from outside its Python: a rank whose Python is held "
                          "(a C extension keeping the GIL) is then kept, and a stopped machine or process is found "
                          "after ping_timeout_s whatever the step time. Needs Linux and UDP from the driver to "
                          "the workers' nodes; without an answer a rank is judged by its polls alone.")
    rendezvous_timeout_s: float = Field(
        60.0, gt=0, description="Process-group formation timeout (the rendezvous store and connecting the ranks).")
    collective_timeout_s: float = Field(
        120.0, gt=0, description="Backstop timeout of one collective; hangs are caught earlier by the controller."
    )
    replacement_timeout_s: float = Field(
        60.0, gt=0, description="How long to wait for resources to start a replacement worker."
    )


class CheckpointConfig(_Strict):
    storage_uri: str = Field("file://./runs", description="fsspec URI of the run root: file://, s3://, memory://.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="Passed to fsspec (e.g. endpoint_url, key, secret for s3)."
    )
    every_steps: int = Field(10, ge=1, description="Checkpoint after every this many steps.")
    num_to_keep: int = Field(3, ge=1, description="Committed checkpoints kept; the newest is never removed.")
    persist_retries: int = Field(5, ge=0, description="Retries of a background persist on storage errors.")
    persist_retry_backoff_s: float = Field(1.0, ge=0, description="First backoff between persist retries (doubles).")
    final_wait_s: float = Field(
        300.0, ge=0, description="If the run's last checkpoint did not commit (storage out longer than the persist's "
                                 "retries, a fence not landed yet), the ranks save the final state again until it "
                                 "commits, for at most this long; past it the run fails, naming the newest "
                                 "committed checkpoint. 0: no second try.")
    restore_wait_s: float = Field(
        300.0, ge=0, description="A restore that can only come from storage (no survivor holds the state) waits for "
                                 "storage this long: to list the committed checkpoints, and while none of them loads "
                                 "(asked again with backoff). Past it the run fails, naming the newest committed "
                                 "checkpoint. It never starts over from step 0 while committed checkpoints exist.")


class StragglerConfig(_Strict):
    """Straggler detection and mitigation (see elastic/policies/straggler.py)."""

    enabled: bool = Field(False, description="Watch for stragglers and act on them.")
    threshold: float = Field(1.5, gt=1, description="A rank's step is slow when its compute time is above "
                                                     "threshold x the other ranks' median at that step.")
    window_steps: int = Field(5, ge=1, description="Act on a rank slow in more than half of its last window_steps "
                                                   "steps...")
    consecutive_windows: int = Field(2, ge=1, description="...and more than half of its last window_steps x "
                                                          "consecutive_windows steps (the window slides by one step).")
    cooldown_s: float = Field(30.0, ge=0, description="No new action this soon after the last one.")


class RunConfig(_Strict):
    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Run folder name.")
    seed: int = Field(0, ge=0)
    num_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    sample_ledger: bool = Field(
        False, description="Record which sample ids every step trained on (ledger.json in the run dir): "
                           "proof of exact-once data across failures and resizes. Costs memory; for drills.")


class ChaosFault(_Strict):
    """One injected fault, keyed by (rank, step): fires once, on the worker holding `rank`,
    when it has completed `at_step` steps and before it starts the next one."""

    action: Literal["kill_node", "kill_process", "freeze_node", "freeze_process", "hang", "slow", "hold_gil"]
    rank: int = Field(ge=0)
    at_step: int = Field(ge=0)
    factor: float = Field(3.0, gt=1, description="slow only: the process computes this many times slower from then on")
    thaw_after_s: float | None = Field(
        None, gt=0, description="freeze_node / freeze_process only: resume (SIGCONT) the frozen processes this "
                                "many seconds later, as a machine back from a partition; default never")
    hold_s: float | None = Field(
        None, gt=0, le=3600, description="hold_gil only: the rank's Python is held this many seconds by one C call "
                                         "that keeps the GIL (as a C extension may): its polls go unanswered while "
                                         "its process sleeps; it then trains on")
    during_upload: bool = Field(
        False, description="at at_step, first wait until this rank's checkpoint is being written to storage, then "
                           "fire: the drill for a machine lost mid-upload. Waits at most "
                           "failure.collective_timeout_s; fires at once if no persist is in flight (the "
                           "fault_injected event says whether an upload was under way)")
    after_persist: bool = Field(
        False, description="at at_step, first wait until this rank's checkpoint persist in flight has ended, then "
                           "fire: the drill for a machine lost just after a checkpoint, whose restore from storage "
                           "must lose only the steps since it. Waits at most failure.collective_timeout_s")

    @model_validator(mode="after")
    def _check_thaw(self) -> "ChaosFault":
        if self.during_upload and self.after_persist:
            raise ValueError("during_upload and after_persist exclude each other: fire during a checkpoint's "
                             "upload, or after its persist")
        if self.thaw_after_s is not None and self.action not in ("freeze_node", "freeze_process"):
            raise ValueError(f"thaw_after_s is for freeze_node and freeze_process, not {self.action}")
        if (self.hold_s is None) != (self.action != "hold_gil"):
            raise ValueError("hold_gil needs hold_s (seconds the rank's Python is held)" if self.hold_s is None
                             else f"hold_s is for hold_gil, not {self.action}")
        return self


def _import_ref(ref: str, field: str) -> Callable:
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


DTYPES = Literal["float32", "bfloat16", "float16"]


class FsdpSpec(_Strict):
    """Settings of the fully-sharded strategy (train.strategy: fsdp), PyTorch's fully_shard (FSDP2)."""

    blocks: list[str] | None = Field(
        None, description="Class names of the submodules sharded as one unit each (e.g. [TransformerBlock]); "
                          "default: every element of every nn.ModuleList, else every child of an "
                          "nn.Sequential root that has parameters. The root is always sharded last.")
    reshard_after_forward: bool = Field(
        True, description="Free gathered parameters after forward (ZeRO-3); false keeps them until backward.")
    param_dtype: DTYPES = Field("float32", description="Dtype of gathered parameters in forward/backward (GPU only).")
    reduce_dtype: DTYPES = Field("float32", description="Dtype of the gradient reduce-scatter (GPU only).")


SCHEDULES = Literal["gpipe", "1f1b", "interleaved_1f1b"]


class PipelineSpec(_Strict):
    """Settings of the pipeline strategy (train.strategy: pipeline): the model is cut into stages at
    the children of its nn.Sequential root, one stage per rank (two or more with interleaved_1f1b),
    and torch.distributed.pipelining runs the schedule. scaling.num_workers = stages x replicas."""

    stages: int = Field(ge=1, description="Pipeline stages (ranks per pipeline replica).")
    schedule: SCHEDULES = Field("1f1b", description="gpipe | 1f1b | interleaved_1f1b (torch.distributed.pipelining).")
    microbatches: int = Field(ge=1, description="Micro-batches per replica per step; they split the replica's share "
                                                "of the global batch evenly.")
    stages_per_rank: int | None = Field(
        None, ge=1, description="Model chunks per rank (interleaved_1f1b only; default 2 there, 1 otherwise).")
    split: list[str] | None = Field(
        None, description="Names of the root's children where stages 2, 3, ... begin (one fewer than the number of "
                          "chunks); default: balanced by parameter count.")
    loss: str = Field(description="module:function(output, target) -> scalar loss, mean over the micro-batch; "
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


class DataSpec(_Strict):
    """A built-in dataset (train.data), instead of a dataset function."""

    format: Literal["parquet"] = Field(description="parquet: rows of Parquet files, by global index.")
    uri: str = Field(description="fsspec URI of the files: one file, a folder, or a glob (s3://bucket/corpus/*.parquet).")
    columns: list[str] | None = Field(None, description="Columns, in the order each sample's tuple has them; default all.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="Passed to fsspec (e.g. endpoint_url, key, secret for s3).")

    def factory(self) -> Callable:
        return functools.partial(_parquet_dataset, self.uri, self.columns, self.storage_options)


def _parquet_dataset(uri: str, columns, storage_options):
    from elastic.data.parquet import ParquetDataset  # pyarrow: imported only by jobs that read Parquet
    return ParquetDataset(uri, columns, storage_options)


class TrainSpec(_Strict):
    """What to train. Each callable is given as 'module:function' so workers can import it."""

    model: str = Field(description="module:function() -> torch.nn.Module")
    dataset: str | None = Field(None, description="module:function() -> map-style dataset (len, getitem)")
    data: DataSpec | None = Field(None, description="A built-in dataset ({format: parquet, uri, columns}) instead of "
                                                    "train.dataset.")
    loss: str | None = Field(None, description="module:function(model, batch) -> scalar loss, mean over the batch "
                                              "(ddp, fsdp; a pipeline uses train.pipeline.loss)")
    optimizer: str | None = Field(None, description="module:function(params) -> optimizer; default AdamW(lr=1e-3)")
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
    scheduler: str | None = Field(
        None, description="module:function(optimizer) -> torch LRScheduler, stepped once per training step; its state "
                          "is a function of the step, replayed on every restore.")
    clip_grad_norm: float | None = Field(
        None, gt=0, description="Clip gradients to this global L2 norm (over every rank's parameters: replicas, "
                                "shards and stages alike).")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="fp32; bf16 (autocast, CPU and GPU); fp16 (autocast with dynamic loss scaling, whose "
                            "scale is saved and restored with the state).")
    bad_step: Literal["raise", "skip", "rollback"] = Field(
        "raise", description="A step whose loss (or, with clipping or fp16, gradient norm) is not finite on any rank: "
                             "raise: stop with an error naming the step; skip: no update on any rank (the samples are "
                             "marked skipped); rollback: skip, and after bad_step_limit in a row return to the newest "
                             "committed checkpoint and skip every batch from there to the last bad one.")
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
                                  "Ray's docs advise inside Ray workers); fork copies the rank's process.")
    bad_step_limit: int = Field(3, ge=1, description="Bad steps in a row that end a skip (error) or trigger a rollback.")

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
        if self.prefetch and self.data_workers:
            raise ValueError(f"train.prefetch (a thread) and train.data_workers={self.data_workers} (processes) both "
                             "read ahead: set one of them")
        return self

    @property
    def dataset_ref(self) -> str:
        """How the job names its data, for messages."""
        return self.dataset or f"train.data ({self.data.format} at {self.data.uri})"

    def resolve(self) -> dict[str, Callable | None]:
        """Import every callable; raises ValueError naming the field that fails."""
        return {
            "model": _import_ref(self.model, "train.model"),
            "dataset": _import_ref(self.dataset, "train.dataset") if self.dataset else self.data.factory(),
            "loss": _import_ref(self.loss, "train.loss") if self.loss else None,
            "stage_loss": _import_ref(self.pipeline.loss, "train.pipeline.loss") if self.pipeline else None,
            "scheduler": _import_ref(self.scheduler, "train.scheduler") if self.scheduler else None,
            "optimizer": _import_ref(self.optimizer, "train.optimizer") if self.optimizer else None,
        }


def batch_plan(global_batch_size: int, world_size: int, micro_batch_size: int | None) -> tuple[int, int]:
    """(per-rank micro-batch, accumulation steps) for a world size; ValueError if it does not split."""
    if global_batch_size % world_size:
        raise ValueError(f"train.global_batch_size={global_batch_size} is not divisible by {world_size} workers")
    per_rank = global_batch_size // world_size
    micro = micro_batch_size or per_rank
    if per_rank % micro:
        raise ValueError(
            f"train.micro_batch_size={micro} does not divide the per-rank batch {per_rank} "
            f"(global {global_batch_size} / {world_size} workers)"
        )
    return micro, per_rank // micro


class JobConfig(_Strict):
    run: RunConfig = Field(default_factory=RunConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    failure: FailureConfig = Field(default_factory=FailureConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    train: TrainSpec
    stragglers: StragglerConfig = Field(default_factory=StragglerConfig)
    chaos: list[ChaosFault] = Field(default_factory=list, description="Faults to inject (drills, tests, demo).")

    @model_validator(mode="after")
    def _check_plan(self) -> "JobConfig":
        # The global batch is a constant of the run: it must split for every world size the run may take.
        sc, tr = self.scaling, self.train
        if tr.strategy == "pipeline":
            self._check_pipeline()
            return self._check_chaos()
        bad = {}
        for w in range(sc.min_size, sc.max_size + 1):
            try:
                batch_plan(tr.global_batch_size, w, tr.micro_batch_size)
            except ValueError as e:
                bad[w] = str(e)
        if bad and sc.min_size == sc.max_size:
            raise ValueError(next(iter(bad.values())) + "; choose a multiple of scaling.num_workers")
        if bad:
            raise ValueError(
                f"train.global_batch_size={tr.global_batch_size} cannot be split for world sizes {sorted(bad)} "
                f"allowed by scaling.min_workers..max_workers={sc.min_size}..{sc.max_size}: "
                + "; ".join(f"{w}: {why}" for w, why in bad.items())
                + ". Choose a global batch divisible by every allowed size, or narrow the range.")
        fs = tr.fsdp
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(fs, name) != "float32" and not sc.use_gpu:
                raise ValueError(f"train.fsdp.{name}={getattr(fs, name)}: mixed precision is a GPU setting; set "
                                 f"scaling.use_gpu: true, or leave it at float32 on CPU")
        if tr.strategy != "fsdp" and fs != FsdpSpec():
            raise ValueError(f"train.fsdp is set but train.strategy={tr.strategy}: set train.strategy: fsdp")
        return self._check_chaos()

    def _check_pipeline(self) -> None:
        """Every layout the run may take (replicas dropped, then stages: elastic.parallel.topology.chain)
        must split the global batch and suit the schedule."""
        from elastic.parallel.topology import Layout, chain
        sc, tr = self.scaling, self.train
        pl = tr.pipeline
        for field, n in (("num_workers", sc.num_workers), ("max_workers", sc.max_size)):
            if n % pl.stages:
                raise ValueError(f"scaling.{field}={n} is not a multiple of train.pipeline.stages={pl.stages}: a "
                                 f"pipeline runs whole replicas of {pl.stages} stages")
        for lay in chain(Layout(pl.stages, sc.max_size // pl.stages), sc.min_size):
            pipeline_plan(tr.global_batch_size, lay.dp, pl.microbatches)
            if pl.schedule == "1f1b" and pl.microbatches < lay.pp:
                raise ValueError(f"train.pipeline.microbatches={pl.microbatches} < {lay.pp} stages: the 1f1b schedule "
                                 f"needs at least one micro-batch per stage")
            if pl.schedule == "interleaved_1f1b" and pl.microbatches % lay.pp:
                raise ValueError(f"train.pipeline.microbatches={pl.microbatches} is not a multiple of {lay.pp} "
                                 f"stages, which interleaved_1f1b needs (a layout this run may take: {lay})")
        if pl.split is not None and len(pl.split) != pl.stages * pl.chunks_per_rank - 1:
            raise ValueError(f"train.pipeline.split names {len(pl.split)} split points; {pl.stages} stages x "
                             f"{pl.chunks_per_rank} chunk(s) per rank need {pl.stages * pl.chunks_per_rank - 1}")
        if tr.fsdp != FsdpSpec():
            raise ValueError("train.fsdp is set but train.strategy=pipeline: set train.strategy: fsdp")
        if self.stragglers.enabled:
            raise ValueError("stragglers.enabled: straggler swaps are not built for pipelines yet (a stage's step "
                             "time includes waiting for its neighbours); leave it off with train.strategy: pipeline")
        if pl.split is not None and sc.min_size < pl.stages:
            raise ValueError("train.pipeline.split fixes the stage boundaries, so the pipeline cannot be re-planned "
                             "onto fewer stages: leave split unset, or set scaling.min_workers to num_workers")

    def _check_chaos(self) -> "JobConfig":
        for i, f in enumerate(self.chaos):
            if f.rank >= self.scaling.num_workers:
                raise ValueError(f"chaos[{i}].rank={f.rank} but scaling.num_workers={self.scaling.num_workers}")
            if f.at_step >= self.run.num_steps:
                raise ValueError(f"chaos[{i}].at_step={f.at_step} must be < run.num_steps={self.run.num_steps}")
        return self


def pipeline_plan(global_batch_size: int, dp: int, microbatches: int) -> int:
    """Samples per micro-batch of one pipeline replica; ValueError if the batch does not split."""
    if global_batch_size % (dp * microbatches):
        raise ValueError(f"train.global_batch_size={global_batch_size} does not split into {dp} replica(s) x "
                         f"train.pipeline.microbatches={microbatches}")
    return global_batch_size // (dp * microbatches)


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(job)"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {msg}" + (f" (got {err['input']!r})" if err["type"] != "value_error" and "input" in err and not isinstance(err["input"], dict) else ""))
    return "invalid job config:\n" + "\n".join(lines)


class ConfigError(ValueError):
    """A user setting is wrong; the message names the field and what to do."""


def load_job(path: str) -> JobConfig:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"job file {path!r} not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"job file {path!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"job file {path!r}: expected a mapping at the top level")
    return parse_job(raw)


def parse_job(raw: dict) -> JobConfig:
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
