"""The whole job: its sections, and the checks that need more than one of them (the batch plan for
every world size the run may take, pipeline layouts, chaos ranks and steps)."""
from __future__ import annotations

from pydantic import Field, model_validator

from elastic.config.base import Strict
from elastic.config.chaos import ChaosFault
from elastic.config.loggers import LoggersConfig
from elastic.config.sections import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, StragglerConfig
from elastic.config.train import FsdpSpec, TrainSpec


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


class JobConfig(Strict):
    """A whole job: `elastic train job.yaml`, or `Trainer(dict)`."""

    run: RunConfig = Field(default_factory=RunConfig, description="The run's name, seed and length.")
    scaling: ScalingConfig = Field(
        default_factory=ScalingConfig, description="Ranks, the elastic world size, spares and resources.")
    failure: FailureConfig = Field(
        default_factory=FailureConfig, description="Fault detection (silence, heartbeat, hangs) and the recovery "
                                                   "budget.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoint storage, interval, retention and storage waits.")
    train: TrainSpec = Field(description="What to train: the callables, the strategy, data, precision.")
    stragglers: StragglerConfig = Field(
        default_factory=StragglerConfig, description="Straggler detection and mitigation.")
    chaos: list[ChaosFault] = Field(default_factory=list, description="Faults to inject (drills, tests, demo).")
    loggers: LoggersConfig = Field(
        default_factory=LoggersConfig, description="TensorBoard and MLflow: the run's curves, every step once.")

    @model_validator(mode="after")
    def _check_plan(self) -> "JobConfig":
        # The global batch is a constant of the run: it must split for every world size the run may take.
        sc, tr = self.scaling, self.train
        self._check_tp()
        self._check_hsdp()
        if tr.strategy == "pipeline":
            self._check_pipeline()
            return self._check_chaos()
        bad = {}
        tp = tr.tp.size
        for w in range(sc.min_size, sc.max_size + 1):
            if w % (tp * self.hsdp_shards):
                continue  # not a layout this run takes: whole replicas of tp (or HSDP shard) ranks only
            try:
                batch_plan(tr.global_batch_size, w // tp, tr.micro_batch_size)
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
        if fs.offload and tr.precision == "fp16":
            raise ValueError("train.fsdp.offload with train.precision: fp16 is not built (the loss scale lives on "
                             "the device, the offloaded gradients in host memory): use bf16, or leave offload off")
        if fs.offload and tr.meta_init:
            raise ValueError("train.fsdp.offload with train.meta_init is not built yet (each rank would allocate its "
                             "part on the device, then offload it, and buffers must stay there): build eagerly, or "
                             "leave offload off")
        return self._check_chaos()

    @property
    def hsdp_shards(self) -> int:
        """Ranks one HSDP replica group shards the state over (1: not hybrid). With tensor
        parallelism a replica group is shards x tp ranks."""
        r = self.train.fsdp.replicate
        return self.scaling.num_workers // (r * self.train.tp.size) if r > 1 else 1

    def _check_hsdp(self) -> None:
        """HSDP: the world is whole replica groups of num_workers / replicate ranks at every size
        (shards x tp ranks each, with tensor parallelism)."""
        sc, tr = self.scaling, self.train
        r, tp = tr.fsdp.replicate, tr.tp.size
        if r == 1:
            return
        if sc.num_workers % (r * tp):
            what = f"train.fsdp.replicate={r} x train.tp.size={tp}" if tp > 1 else f"train.fsdp.replicate={r}"
            raise ValueError(f"{what} does not divide scaling.num_workers={sc.num_workers}: "
                             f"each replica group shards the state over num_workers / replicate ranks")
        shards = sc.num_workers // (r * tp)
        if shards == 1:
            tail = ("use train.strategy: ddp with train.tp.size" if tp > 1 else "use train.strategy: ddp")
            raise ValueError(f"train.fsdp.replicate={r} leaves one shard per group (scaling.num_workers="
                             f"{sc.num_workers}), which shards nothing: {tail}")
        group = shards * tp
        for field, n in (("min_workers", sc.min_size), ("max_workers", sc.max_size)):
            if n % group:
                raise ValueError(f"scaling.{field}={n} is not a multiple of the HSDP group size {group} "
                                 f"(num_workers / train.fsdp.replicate): the run grows and shrinks by whole groups")

    def _check_tp(self) -> None:
        """With tensor parallelism, every world size the run may take is whole replicas of
        stages x tp ranks; the rest (divisibility of heads and widths) is the strategy's check,
        on the meta device (elastic/parallel/tensor.py)."""
        sc, tr = self.scaling, self.train
        tp = tr.tp.size
        if tp == 1:
            if tr.tp.plan is not None:
                raise ValueError("train.tp.plan is set but train.tp.size is 1: set train.tp.size")
            if tr.tp.sequence_parallel:
                raise ValueError("train.tp.sequence_parallel is set but train.tp.size is 1: sequence parallelism "
                                 "splits the sequence over the tp ranks; set train.tp.size")
            return
        if tr.tp.sequence_parallel and tr.tp.plan is not None:
            raise ValueError("train.tp.sequence_parallel applies to the built-in plan, and train.tp.plan is set: "
                             "apply torch's SequenceParallel in your plan instead, and leave sequence_parallel off")
        stages = tr.pipeline.stages if tr.pipeline else 1
        unit = stages * tp
        what = f"train.pipeline.stages={stages} x train.tp.size={tp}" if tr.pipeline else f"train.tp.size={tp}"
        if tr.pipeline and sc.min_size < unit:
            raise ValueError(f"scaling.min_workers={sc.min_size}: with train.tp.size={tp} a pipeline keeps its "
                             f"{stages} stages (it is not re-partitioned onto fewer); set scaling.min_workers >= {unit}")
        for field, n in (("num_workers", sc.num_workers), ("min_workers", sc.min_size), ("max_workers", sc.max_size)):
            if n % unit:
                raise ValueError(f"scaling.{field}={n} is not a multiple of {what}: the world is replicas x "
                                 f"stages x tp, and grows and shrinks by whole replicas of {unit} ranks")

    def _check_pipeline(self) -> None:
        """Every layout the run may take (replicas dropped, then stages: elastic.parallel.topology.chain)
        must split the global batch and suit the schedule."""
        from elastic.parallel.topology import Layout, chain
        sc, tr = self.scaling, self.train
        pl = tr.pipeline
        tp = tr.tp.size
        for field, n in (("num_workers", sc.num_workers), ("max_workers", sc.max_size)):
            if n % pl.stages and tp == 1:  # with tp: _check_tp
                raise ValueError(f"scaling.{field}={n} is not a multiple of train.pipeline.stages={pl.stages}: a "
                                 f"pipeline runs whole replicas of {pl.stages} stages")
        for lay in chain(Layout(pl.stages, sc.max_size // (pl.stages * tp), tp), sc.min_size):
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
