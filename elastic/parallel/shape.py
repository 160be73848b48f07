"""How a strategy's layout grows and shrinks: what the controller asks instead of naming a strategy.

A `Shape` is pure data plus pure functions over `elastic.parallel.topology`. `shape_for(job)`
says which shape a job's strategy has, from its configuration alone (no torch: the controller
imports this); the controller sizes, grows, shrinks and re-plans through it and never tests a
strategy's name:
  * flat (ddp, fsdp): every rank is a data-parallel replica (pp = 1); any world size between
    scaling.min_workers and max_workers; a shrink renumbers the survivors 0..k-1;
  * staged (pipeline, or any strategy with tensor parallelism): ranks come and go in whole
    replicas of `stages x tp` ranks, along the topology's chain (replicas first, then stages); a
    shrink keeps each survivor on its slot (stage, tp index) where it can.
  * HSDP (fsdp with `shards` > 1) is staged too: whole replica groups of `shards` (x tp) ranks,
    each rank a slot (its shard and tp index), restored like a pipeline's stage from another
    group's rank at the same slot.
`sharded` says whether one rank holds the only copy of its part of the state (fsdp): then no
single survivor holds it all, and a planned change moves every rank's part (fsdp x tp too: each
tp slice is re-sharded over dp, elastic.parallel.resharding).
"""
from __future__ import annotations

from dataclasses import dataclass

from elastic.parallel.topology import Layout, grow_to, reassign, shrink_to


@dataclass(frozen=True)
class Shape:
    stages: int = 1  # pipeline stages at full size
    sharded: bool = False
    staged: bool = False  # resizes walk the topology's chain of whole layouts
    tp: int = 1  # tensor-parallel ranks per stage (fixed for the run)
    shards: int = 1  # HSDP: ranks per replica group (fixed for the run)
    # Each rank holds state no other rank has (train.grad_compression's error feedback): a rank
    # lost to a fault is restored from storage, never from a replica's memory.
    private: bool = False

    def __post_init__(self):
        if self.tp > 1 or self.shards > 1:
            object.__setattr__(self, "staged", True)  # whole replicas of stages x shards x tp ranks

    @property
    def unit(self) -> int:
        """Ranks come and go in multiples of this (a replica's ranks)."""
        return self.stages * self.shards * self.tp

    def layout(self, world_size: int) -> Layout:
        return Layout(self.stages, world_size // self.unit, self.tp, self.shards)

    def grow(self, top: Layout, current: Layout, extra: int) -> Layout | None:
        """The layout `extra` more ranks make; None when they make none (staged: not a whole one)."""
        if self.staged:
            return grow_to(top, current, extra)
        return Layout(1, current.world_size + extra)

    def shrink(self, top: Layout, old: Layout, survivors: list[int], min_size: int,
               holders=frozenset()) -> tuple[Layout, dict[int, int]]:
        """The layout the survivors fill, and old rank -> new rank for those that keep a place
        (`holders`, the ranks that hold the newest state, keep theirs first)."""
        if self.staged:
            new = shrink_to(top, len(survivors), min_size)
            return new, reassign(old, sorted(survivors), new, holders)
        return Layout(1, len(survivors)), {old_rank: new for new, old_rank in enumerate(sorted(survivors))}

    def swappable(self, layout: Layout) -> bool:
        """Whether a rank can be swapped for a spare at a planned stop with its state from memory:
        every rank holds it (ddp), its shards are offered at the stop (fsdp), or another replica
        holds its slot. Not with one replica of a staged layout (a pipeline or tp at dp 1): each
        slot's state is in its one rank only, and nothing offers it."""
        return self.sharded or not self.staged or layout.dp > 1

    def offer_keepers(self, members: list[int], leaving: int | None) -> frozenset[int] | None:
        """At a planned change, the ranks that keep their part of the state in memory (moved rank to
        rank later); the others publish theirs. None: nothing is offered (a replica holds it all).
        A pipeline's parts are published by every rank: a re-partition moves them by name (with
        tensor parallelism a pipeline keeps its stages: config/job.py). fsdp x tp: as fsdp (a rank
        that stays keeps its number, so its tp index)."""
        if self.sharded:
            return frozenset(r for r in members if r != leaving)
        if self.tp > 1 or self.shards > 1:  # replicas of each slot hold it (ddp, pipeline, HSDP)
            return None
        if self.staged:
            return frozenset()
        return None


def shape_for(job) -> Shape:
    """The job's strategy's `Shape`: flat (ddp; fsdp, `sharded`); staged with tensor parallelism;
    a pipeline's whole layouts of the topology's chain (replicas come and go first, then stages);
    HSDP's whole replica groups of `shards` ranks, each slot held by every group (not `sharded`:
    a lost rank's part survives in its peers at the same shard)."""
    tr = job.train
    if tr.strategy == "pipeline":
        return Shape(stages=tr.pipeline.stages, staged=True, tp=tr.tp.size)
    if tr.strategy == "fsdp" and job.hsdp_shards > 1:
        return Shape(shards=job.hsdp_shards, tp=tr.tp.size)
    return Shape(sharded=tr.strategy == "fsdp", tp=tr.tp.size,
                 private=tr.grad_compression.error_feedback)
