"""Where each rank sits: a named mesh (dp, pp, tp) of replicas x pipeline stages x tensor slices.

One layout for every strategy. DDP and FSDP are (dp=world, pp=1, tp=1). A
pipeline has `pp` stages and `dp` replicas of the whole pipeline; tensor
parallelism splits every stage's layers over `tp` ranks; HSDP shards a
replica's state over `shards` ranks (FSDP within a replica, `dp` replicas of
it). A replica is `pp x shards x tp` ranks, each holding one *slot* of the
model (slot = (stage x shards + shard) x tp + tp index):

    rank = replica x slots + slot

Ranks of one replica that differ only in their shard read different samples
(data rank = replica x shards + shard); stages and tp slices share theirs.

replica-major, so adding a replica appends ranks and numbers nobody else, and
the ranks of a tp group are consecutive (placed on one node where it can hold
them: the fastest links). Every rank of a slot's `dp` group holds the same
state (a replica of it), so a lost rank is restored from another replica of
its slot. Resizes walk one chain of layouts, largest first: drop whole
replicas while there is more than one, then re-partition the model over fewer
stages (tp and shards never change in a run):

    (pp=3, dp=2) -> (3, 1) -> (2, 1) -> (1, 1)

Shrinking picks the largest layout the survivors fill, growing the largest the
new capacity fills. All functions here are pure.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Layout:
    pp: int  # pipeline stages
    dp: int  # data-parallel replicas (of the whole pipeline)
    tp: int = 1  # tensor-parallel ranks per stage
    shards: int = 1  # HSDP: ranks a replica's state is sharded over (1: not hybrid)

    @property
    def slots(self) -> int:
        """Ranks per replica: each holds a different part of the model."""
        return self.pp * self.shards * self.tp

    @property
    def data_world(self) -> int:
        """How many ways the global batch splits: replicas x shards (stages and tp share samples)."""
        return self.dp * self.shards

    def data_rank(self, rank: int) -> int:
        """Which share of the global batch `rank` reads (0..data_world-1)."""
        return self.replica_of(rank) * self.shards + self.shard_of(rank)

    def shard_of(self, rank: int) -> int:
        return (self.slot_of(rank) // self.tp) % self.shards

    @property
    def world_size(self) -> int:
        return self.slots * self.dp

    def slot_of(self, rank: int) -> int:
        """Which part of the model `rank` holds (its stage and tp index): replicas of a slot hold
        the same state."""
        return rank % self.slots

    def stage_of(self, rank: int) -> int:
        return self.slot_of(rank) // (self.shards * self.tp)

    def tp_of(self, rank: int) -> int:
        return rank % self.tp

    def replica_of(self, rank: int) -> int:
        return rank // self.slots

    def rank_of(self, replica: int, slot: int) -> int:
        return replica * self.slots + slot

    def __str__(self) -> str:
        tp = f" x {self.tp} tensor slice(s)" if self.tp > 1 else ""
        if self.shards > 1:
            return f"{self.shards} shard(s){tp} x {self.dp} replica(s)"
        return f"{self.pp} stage(s){tp} x {self.dp} replica(s)"


def chain(top: Layout, min_world: int = 1) -> list[Layout]:
    """Every layout a run may take, largest first: replicas dropped one by one, then stages."""
    out = [Layout(top.pp, d, top.tp, top.shards) for d in range(top.dp, 0, -1)]
    out += [Layout(p, 1, top.tp, top.shards) for p in range(top.pp - 1, 0, -1)]
    return [lay for lay in out if lay.world_size >= min_world]


def shrink_to(top: Layout, num_ranks: int, min_world: int) -> Layout | None:
    """The largest layout of the chain that `num_ranks` ranks fill; None below min_world."""
    for lay in chain(top, min_world):
        if lay.world_size <= num_ranks:
            return lay
    return None


def grow_to(top: Layout, current: Layout, extra: int) -> Layout | None:
    """The largest layout of the chain, bigger than `current`, that `extra` more ranks fill."""
    for lay in chain(top):
        if current.world_size < lay.world_size <= current.world_size + extra:
            return lay
    return None


def reassign(old: Layout, survivors: list[int], new: Layout, holders=frozenset()) -> dict[int, int]:
    """old rank -> new rank for the survivors that fit `new`. A survivor keeps its slot (stage and
    tp index) where it can (it keeps its state in memory), those in `holders` (that hold the
    newest state) first: a replacement that joined without state never takes a slot from one
    that has it. The rest fill the places left, in rank order. Survivors beyond new.world_size
    get no place (the caller releases them)."""
    mapping: dict[int, int] = {}
    free = [new.rank_of(d, s) for d in range(new.dp) for s in range(new.slots)]
    if new.slots == old.slots:
        for s in range(new.slots):
            mine = sorted((r for r in survivors if old.slot_of(r) == s), key=lambda r: (r not in holders, r))
            for d, r in enumerate(mine[:new.dp]):
                mapping[r] = new.rank_of(d, s)
                free.remove(mapping[r])
    rest = [r for r in sorted(survivors) if r not in mapping]
    for r, place in zip(rest, sorted(free)):
        mapping[r] = place
    return mapping


def slot_sources(old: Layout, mapping: dict[int, int], new: Layout, survivor_steps: dict[int, int]) -> tuple[int, ...] | None:
    """For a memory restore after a change of replicas: per new slot (stage and tp index), the
    new rank of a survivor that held that slot at the newest step. None when some slot has no
    such survivor (the stages changed, or a whole slot was lost): then the state comes from
    storage."""
    if new.slots != old.slots or not survivor_steps:
        return None
    step = max(survivor_steps.values())
    out = []
    for s in range(new.slots):
        holders = sorted(mapping[r] for r, st in survivor_steps.items()
                         if st == step and r in mapping and old.slot_of(r) == s and new.slot_of(mapping[r]) == s)
        if not holders:
            return None
        out.append(holders[0])
    return tuple(out)
