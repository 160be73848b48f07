"""The no-framework peer of `python -m benchmarks pipeline`: the same pipeline written the way the
`torch.distributed.pipelining` docs write it, in plain processes started by torchrun, on gloo.

    GPT_LAYERS=6 GPT_DIM=128 GPT_CONTEXT=64 python -m torch.distributed.run --standalone \
        --nproc-per-node 4 -m benchmarks.plain_pipeline --stages 2 --split 4 --steps 60

Everything but the framework is elastic's: the model (`examples.gpt`, sized by GPT_LAYERS /
GPT_DIM / GPT_CONTEXT), the cut (`--split`: the root's children where stages 2, 3, ... begin,
as elastic's planner balanced them), the data (the example's dataset, `default_collate` of the
indices elastic's global sample order gives each replica, read on the first and last stage
only), the optimizer, the schedule, the global batch and the micro-batches.

Set up to win, as torch's docs and torchtitan do: one `DeviceMesh` of (dp, pp), or (dp, pp, tp)
with `--tp` (each stage split by `parallelize_module` with elastic's built-in plan's styles); with
replicas each stage module is wrapped in `DistributedDataParallel` over its dp group, which
`PipelineStage` drives itself (no_sync on every micro-batch but the last, whose backward
overlaps DDP's bucketed all-reduce); no loss all-reduce, no `.item()`, no checkpoint.

The Ray Train peer (`benchmarks.pipeline`) runs `build_pipeline` and `run_step` inside its
training function: the same user code, under Ray Train.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
STEP_LOG_ENV = "ELASTIC_BENCH_STEP_LOG"  # file that global rank 0 appends one line per optimizer step to


# ---------------------------------------------------------------- the step clock (both systems)
class StepClock:
    """An optimizer post-step hook: global rank 0 appends the wall-clock time of every optimizer
    step to a file. The same hook in every system, so steps/s is measured the same way for all:
    from inside the training process, one line per step (one O_APPEND write, a few microseconds)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, optimizer, args, kwargs) -> None:
        if not (dist.is_initialized() and dist.get_rank() == 0):
            return
        if torch.cuda.is_initialized():
            # On a GPU the step is queued, not done, when optimizer.step() returns: time its end.
            # Every system pays this one synchronisation per step; on CPU nothing is initialised.
            torch.cuda.synchronize()
        line = f'{{"t": {time.time():.6f}, "pid": {os.getpid()}, "threads": {torch.get_num_threads()}}}\n'
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def timed_optimizer(params):
    """`examples.gpt:build_optimizer`, with the step clock when ELASTIC_BENCH_STEP_LOG is set.
    elastic's job names it as `train.optimizer`; the plain and Ray Train peers call it directly."""
    from examples.gpt import build_optimizer
    optimizer = build_optimizer(params)
    path = os.environ.get(STEP_LOG_ENV)
    if path:
        optimizer.register_step_post_hook(StepClock(path))
    return optimizer


def step_rate(times: list[float], warmup_steps: int) -> dict:
    """Steady-state steps/s from one rank's step-end times: the steps after `warmup_steps`,
    (n - 1) intervals over the time between the first and the last of them; plus the median
    interval (robust to one slow step)."""
    ts = sorted(times)[warmup_steps:]
    if len(ts) < 3:
        raise ValueError(f"{len(times)} step times with {warmup_steps} warm-up steps leave fewer than 3 to time")
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    return {"steps_per_s": (len(ts) - 1) / (ts[-1] - ts[0]), "step_s": (ts[-1] - ts[0]) / (len(ts) - 1),
            "median_step_s": gaps[len(gaps) // 2], "timed_steps": len(ts) - 1}


# ---------------------------------------------------------------- the pipeline, as torch's docs build it
def chunks_from_split(names: list[str], split: list[str]) -> list[list[str]]:
    """The root's children grouped into chunks that begin at the names in `split`."""
    bounds = [0] + [names.index(s) for s in split] + [len(names)]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split {split} must name children of the root in order, none first: {names}")
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


@dataclass
class PipelineRank:
    """What one rank holds: its stage modules, their schedule, the optimizer, its coordinate."""
    schedule: object
    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer
    stage: int
    replica: int
    pp: int
    dp: int

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1


def build_pipeline(mesh, model: nn.Sequential, split: list[str], schedule: str, microbatches: int,
                   loss_fn, stages_per_rank: int = 1) -> PipelineRank:
    """Cut `model` (built from the same seed on every rank) at `split`, keep this rank's chunks
    (chunk s + c x pp on stage s: torch's interleaved layout), split each over the mesh's "tp"
    axis if it has one (the `ColwiseParallel`/`RowwiseParallel` styles on the layers elastic's
    built-in plan names, as torchtitan applies them per stage), wrap each in DDP over the dp group
    when there are replicas (with tp: DDP's 2-D mode, `device_mesh=mesh["dp"]`), and make the
    schedule."""
    from torch.distributed import pipelining as pl
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = mesh.mesh_dim_names
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    pp, dp = mesh.size(names.index("pp")), mesh.size(names.index("dp"))
    tp = mesh.size(names.index("tp")) if "tp" in names else 1
    stage, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    chunks = chunks_from_split([n for n, _ in model.named_children()], split)
    if len(chunks) != pp * stages_per_rank:
        raise ValueError(f"{len(chunks)} chunks from split {split}, but {pp} stages x {stages_per_rank} per rank")
    modules: list[nn.Module] = []
    for c in range(stages_per_rank):
        mod = nn.Sequential(OrderedDict((u, getattr(model, u)) for u in chunks[stage + c * pp]))
        if tp > 1:
            split_tensors(mod, mesh["tp"])
            modules.append(DDP(mod, device_mesh=mesh["dp"]) if dp > 1 else mod)
        else:
            modules.append(DDP(mod, process_group=dp_group) if dp > 1 else mod)
    stages = [pl.PipelineStage(m, stage + c * pp, pp * stages_per_rank, torch.device("cpu"), group=pp_group)
              for c, m in enumerate(modules)]
    if schedule == "interleaved_1f1b":
        sched = pl.ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)
    else:
        cls = pl.ScheduleGPipe if schedule == "gpipe" else pl.Schedule1F1B
        sched = cls(stages[0], microbatches, loss_fn=loss_fn)
    optimizer = timed_optimizer([p for m in modules for p in m.parameters()])
    return PipelineRank(sched, modules, optimizer, stage, replica, pp, dp)


def split_tensors(module: nn.Module, tp_mesh) -> None:
    """The built-in plan's layers of `module` split with torch's own styles (the plain peers' plan)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from elastic.parallel.tensor import builtin_plans  # which layers split how (the plan, not a framework)
    for name, plan in builtin_plans(module).items():
        parallelize_module(module.get_submodule(name), tp_mesh,
                           {c: ColwiseParallel() if s == "colwise" else RowwiseParallel() for c, s in plan.items()})


def run_step(rank: PipelineRank, dataset, order, step: int, global_batch: int) -> torch.Tensor | None:
    """One optimizer step: the first stage feeds the replica's inputs, the last its targets.
    Returns the mean micro-batch loss on the last stage, else None."""
    rank.optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    if rank.first or rank.last:
        idx = order.rank_indices(step, global_batch, rank.dp, rank.replica)
        x, y = default_collate([dataset[j] for j in idx])
    if rank.first and rank.last:
        rank.schedule.step(x, target=y, losses=losses)
    elif rank.first:
        rank.schedule.step(x)
    elif rank.last:
        rank.schedule.step(target=y, losses=losses)
    else:
        rank.schedule.step()
    rank.optimizer.step()
    return torch.stack([x.detach() for x in losses]).mean() if losses else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plain_pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--split", required=True, help="comma-separated children of the root where stages 2, 3, ... begin")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--stages-per-rank", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (the built-in plan)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from torch.distributed.device_mesh import init_device_mesh

    from elastic.data.order import GlobalOrder  # the sample order only: a pure function of (len, seed)
    from examples.gpt import build_dataset, build_model, stage_loss

    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    world = dist.get_world_size()
    if world % (args.stages * args.tp):
        raise SystemExit(f"world size {world} is not a multiple of --stages {args.stages} x --tp {args.tp}")
    if args.tp > 1:  # elastic's numbering: replica, then stage, then tp index
        mesh = init_device_mesh("cpu", (world // (args.stages * args.tp), args.stages, args.tp),
                                mesh_dim_names=("dp", "pp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world // args.stages, args.stages), mesh_dim_names=("dp", "pp"))
    torch.manual_seed(args.seed)  # the same initial weights on every rank, as elastic's replica 0
    model = build_model()
    rank = build_pipeline(mesh, model, args.split.split(","), args.schedule, args.microbatches, stage_loss,
                          args.stages_per_rank)
    dataset = build_dataset()
    order = GlobalOrder(len(dataset), args.seed)
    for step in range(args.steps):
        run_step(rank, dataset, order, step, args.global_batch)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
