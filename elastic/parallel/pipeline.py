"""Pipeline stages: the model cut into consecutive chunks, one stage per rank, run by a
`torch.distributed.pipelining` schedule, with data-parallel replicas of the whole pipeline.

The cut follows the user's module boundaries: the children of an `nn.Sequential`
root, each passing one tensor (or a tuple) to the next. Stages are balanced by
parameter count unless `train.pipeline.split` names where they begin. With
interleaved_1f1b a rank holds `stages_per_rank` chunks: chunk c of stage s is
model chunk s + c x pp (torch's interleaved layout).

A rank's module is an `nn.Sequential` of its chunks' children under their
original names, so its state dict (model and optimizer) is keyed by the
unsplit model's fully-qualified names: a checkpoint saved at 4 stages loads
at 2 stages, into DDP or into FSDP, and the other way round (DCP reads what
each rank's keys ask for). The optimizer's param groups are saved in the
unsplit model's form (every group lists all its names) so that every rank
saves the same value under the same key.

Every rank of a stage's replicas holds the same state: gradients are averaged
over the `dp` axis with one flat all-reduce in fixed order (as DataParallel),
and the stage's buffers broadcast from its first replica (buffers.py), so a
lost stage is restored from a surviving replica's memory.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from elastic.parallel.ddp import DataParallel
from elastic.parallel.topology import Layout, chain


class PlanError(ValueError):
    """The model cannot be cut as asked; the message names the setting."""


# ---------------------------------------------------------------- planning (pure)
def units_of(model: nn.Module) -> list[tuple[str, int]]:
    """(child name, parameter count) of the root's children: the units a pipeline is cut at."""
    if not isinstance(model, nn.Sequential):
        raise PlanError(f"train.strategy=pipeline cuts the model at the children of an nn.Sequential root; "
                        f"train.model returns {type(model).__name__}. Return nn.Sequential(embedding, *blocks, head) "
                        f"(each child takes the previous child's output)")
    return [(n, sum(p.numel() for p in c.parameters())) for n, c in model.named_children()]


def balanced_bounds(sizes: list[int], chunks: int) -> list[int]:
    """Cut `sizes` (in order) into `chunks` non-empty runs that minimise the largest run's sum.
    Returns the chunk boundaries [0, b1, ..., len(sizes)]."""
    n = len(sizes)
    if chunks > n:
        raise PlanError(f"cannot cut {n} units into {chunks} pipeline chunks")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: the smallest max-run-sum cutting the first i units into k runs
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds = [n]
    for k in range(chunks, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def plan_chunks(units: list[tuple[str, int]], num_chunks: int, split: list[str] | None = None) -> list[list[str]]:
    """The unit names of every model chunk, in pipeline order."""
    names = [n for n, _ in units]
    if split is None:
        b = balanced_bounds([s for _, s in units], num_chunks)
    else:
        unknown = [s for s in split if s not in names]
        if unknown:
            raise PlanError(f"train.pipeline.split: {unknown} are not children of the model's root; it has {names}")
        b = [0] + [names.index(s) for s in split] + [len(names)]
        if any(x >= y for x, y in zip(b, b[1:])):
            raise PlanError(f"train.pipeline.split={split} must name children in model order, none first and none "
                            f"twice (the root's children: {names})")
    return [names[x:y] for x, y in zip(b, b[1:])]


def chunks_of_stage(stage: int, pp: int, per_rank: int) -> list[int]:
    """Model chunks held by pipeline stage `stage` (torch's interleaved layout)."""
    return [stage + c * pp for c in range(per_rank)]


def stage_of_unit(chunks: list[list[str]], pp: int) -> dict[str, int]:
    """unit name -> the stage that holds it, for a layout with `pp` stages."""
    return {u: i % pp for i, chunk in enumerate(chunks) for u in chunk}


# ---------------------------------------------------------------- the strategy
class Pipeline(DataParallel):
    name = "pipeline"
    overlap = False  # the schedule runs many backwards per step: one flat all-reduce after them
    whole_grads_everywhere = False  # each stage holds its own parameters' gradients

    @classmethod
    def check_job(cls, job, model_fn) -> None:
        """Cut the model (built on the meta device) for every stage count the run may take."""
        pl = job.train.pipeline
        with torch.device("meta"):
            model = model_fn()
        cls.check_model(job, model)
        units = units_of(model)
        tp = job.train.tp.size
        for pp in sorted({lay.pp for lay in chain(Layout(pl.stages, 1, tp), job.scaling.min_size)}, reverse=True):
            try:
                plan_chunks(units, pp * pl.chunks_per_rank, pl.split if pp == pl.stages else None)
            except PlanError as e:
                raise PlanError(f"train.pipeline: {pp} stage(s) x {pl.chunks_per_rank} chunk(s) per rank: {e}") from None

    def __init__(self, mesh, spec, layout: Layout, rank: int):
        super().__init__(mesh, spec)
        self.layout = layout
        self.stage = layout.stage_of(rank)
        self.tp_index = layout.tp_of(rank)
        self.replica = layout.replica_of(rank)
        self.cfg = spec.pipeline
        self.per_rank = self.cfg.chunks_per_rank
        self.units: list[tuple[str, int]] = []  # the unsplit model's (child, parameter count)
        self.chunks: list[list[str]] = []  # this rank's chunks' unit names
        self.full_groups: list[dict] = []  # the unsplit model's optimizer param groups, by name
        self._schedule = None
        self._schedule_for = None

    @property
    def layout_key(self):
        return ("pipeline", self.layout.pp, self.stage, self.tp_index)

    @property
    def loss_ranks(self) -> int:
        return self.layout.dp * self.layout.tp  # the last stage's ranks: each replica's tp ranks alike

    @property
    def grad_copies(self) -> int:
        return self.layout.dp  # a slot's replicas hold copies; stages (and tp slices) hold different parameters

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.layout.pp - 1

    @property
    def needs_data(self) -> bool:
        return self.first or self.last

    def plan(self, pp: int | None = None) -> list[list[str]]:
        """Every model chunk's unit names for `pp` stages (default: this layout's)."""
        pp = pp or self.layout.pp
        split = self.cfg.split if pp == self.cfg.stages else None
        return plan_chunks(self.units, pp * self.per_rank, split)

    def note_optimizer(self, full_model: nn.Module, make_opt) -> None:
        """Record the unsplit model's param groups by name (the optimizer factory applied to the
        whole model), so every stage saves them in one form."""
        names = {id(p): n for n, p in full_model.named_parameters()}
        groups = make_opt(full_model.parameters()).param_groups
        self.full_groups = [{**{k: v for k, v in g.items() if k != "params"},
                             "params": [names[id(p)] for p in g["params"]]} for g in groups]

    def prepare(self, model: nn.Module, sync_init: bool) -> nn.Module:
        self.units = units_of(model)
        all_chunks = self.plan()
        mine = chunks_of_stage(self.stage, self.layout.pp, self.per_rank)
        self.chunks = [all_chunks[c] for c in mine]
        stage_module = nn.Sequential(OrderedDict((u, getattr(model, u)) for chunk in self.chunks for u in chunk))
        # A survivor keeps its module across groups (and strategy objects): the cut travels with it,
        # and so do the unsplit model's param groups (a new strategy object never saw the build).
        stage_module.elastic_chunks = self.chunks
        stage_module.elastic_full_groups = self.full_groups
        return super().prepare(stage_module, sync_init)  # replica 0's init, over the dp axis

    # ---------------------------------------------------------------- the step
    def _schedule_of(self, model: nn.Module):
        if self._schedule_for is model:
            return self._schedule
        from torch.distributed import pipelining as pl
        num = self.layout.pp * self.per_rank
        device = next(model.parameters()).device
        stages = [pl.PipelineStage(nn.Sequential(OrderedDict((u, getattr(model, u)) for u in chunk)), idx, num,
                                   device, group=self.mesh.get_group("pp"))
                  for idx, chunk in zip(chunks_of_stage(self.stage, self.layout.pp, self.per_rank),
                                        model.elastic_chunks)]
        loss = self.loss_fn
        if self.cfg.schedule == "interleaved_1f1b":
            self._schedule = pl.ScheduleInterleaved1F1B(stages, self.cfg.microbatches, loss_fn=loss)
        else:
            cls = pl.ScheduleGPipe if self.cfg.schedule == "gpipe" else pl.Schedule1F1B
            self._schedule = cls(stages[0], self.cfg.microbatches, loss_fn=loss)
        self._schedule_for = model
        return self._schedule

    def train_step(self, model: nn.Module, idx: list[int], load, loss_fn, micro: int) -> torch.Tensor:
        """One replica's share of the step through the pipeline: the first stage feeds the inputs,
        the last computes the loss of each micro-batch (mean over it) and the schedule scales the
        gradients by 1/microbatches. Returns the replica's mean loss on the last stage, else 0."""
        self.loss_fn = loss_fn
        schedule = self._schedule_of(model)
        batch = load(idx) if self.needs_data else None
        args, kwargs, losses = (), {}, []
        if self.first:
            args = tuple(batch[:-1]) if isinstance(batch, (list, tuple)) else (batch,)
        if self.last:
            kwargs = {"target": batch[-1], "losses": losses}
        schedule.step(*args, **kwargs)
        if self.last:
            return torch.stack([x.detach() for x in losses]).mean()
        return torch.zeros(())

    def reduce_gradients(self, model: nn.Module, extra: torch.Tensor | None = None) -> None:
        """The stage's gradients averaged and its buffers made the first replica's, over the
        stage's `dp` group (`_reduce_flat`); nothing to do for a stage with no replica."""
        if self.layout.dp > 1:
            self._reduce_flat(model)

    # ---------------------------------------------------------------- state by name
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        if not self.full_groups:  # a survivor in a new group: its strategy object is new, its module is not
            self.full_groups = getattr(model, "elastic_full_groups", [])
        state = super().state_dict(model, optimizer)
        state["optim"]["param_groups"] = self._canonical_groups(state["optim"]["param_groups"])
        return state

    def _canonical_groups(self, groups: list[dict]) -> list[dict]:
        """The unsplit model's groups, each with this stage's hyperparameters where it has the
        group (a learning-rate schedule moves them), the factory's otherwise."""
        if not self.full_groups:
            return groups
        out = []
        for full in self.full_groups:
            mine = next((g for g in groups if g["params"] and g["params"][0] in full["params"]), None)
            hyper = {k: v for k, v in (mine or full).items() if k != "params"}
            out.append({**hyper, "params": list(full["params"])})
        return out

    def offer(self, state: dict, rank: int, world: int, step: int, into: dict | None = None) -> dict | None:
        """This stage's state by name, as CPU copies (replica 0 only; the other replicas hold the
        same): for a planned re-partition, and as the in-memory copy of a pipeline with one
        replica (elastic/runtime/memory_copies.py), which training goes on past. With tensor
        parallelism, this rank's tensor slice of each tensor (its local part). Copied into `into`'s
        tensors (an older part no longer needed) where they match."""
        if self.replica != 0:
            return None
        from elastic.parallel.resharding import copy_into, flatten
        from elastic.parallel.tensor import local
        old = (into or {}).get("tensors", {})
        return {"step": step, "stage": self.stage, "tp_index": self.tp_index,
                "tensors": {k: copy_into(local(v), old.get(k)) for k, v in flatten(state)
                            if isinstance(v, torch.Tensor)}}

    def needed_stages(self, old_pp: int) -> list[int]:
        """Old ranks of replica 0 holding the units this rank's new state needs: the old stages,
        each at this rank's tp index (rank = stage x tp + tp index). With tp, only at the same
        stage count (a slice's local part is the same shape only in the same layout)."""
        from elastic.parallel.resharding import ReshardError
        tp = self.layout.tp
        if tp > 1 and old_pp != self.layout.pp:
            raise ReshardError(f"a pipeline with tp={tp} re-partitioned from {old_pp} to {self.layout.pp} stages in "
                               f"memory: not supported (restore from storage)")
        where = stage_of_unit(self.plan(old_pp), old_pp)
        units = {u for chunk in self.chunks for u in chunk}
        return sorted({where[u] * tp + self.tp_index for u in units})

    def assemble(self, state: dict, offers: dict[int, dict]) -> int:
        """Fill this rank's fresh state (keyed by name) from old stages' offers. Returns the step."""
        from elastic.parallel.resharding import ReshardError, flatten, set_leaf
        steps = {o["step"] for o in offers.values()}
        if len(steps) != 1:
            raise ReshardError(f"offers from different steps: {sorted(steps)}")
        from elastic.parallel.tensor import local
        have: dict = {}
        for o in offers.values():
            if o.get("tp_index", 0) != self.tp_index:
                raise ReshardError(f"rank at tp index {self.tp_index} offered tp index {o.get('tp_index')}'s slice")
            have.update(o["tensors"])
        for path, v in flatten(state):
            if not isinstance(v, torch.Tensor):
                continue
            if path not in have:
                raise ReshardError(f"no old stage offered {'.'.join(map(str, path))}")
            src, dst = have[path], local(v)
            if dst.shape == src.shape:
                with torch.no_grad():
                    dst.copy_(src)
            elif dst is v:
                set_leaf(state, path, src.clone())
            else:
                raise ReshardError(f"{'.'.join(map(str, path))}: a tensor slice of shape {tuple(dst.shape)} offered "
                                   f"as {tuple(src.shape)}")
        return steps.pop()
