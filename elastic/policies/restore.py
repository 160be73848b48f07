"""Where a group's state comes from after a failure or a planned change: pure decisions.

Memory first (a survivor's replica, or every rank's offered part re-sharded), storage when memory
cannot hold the newest state. The controller asks here and does what the answer says; the
strategy's `Shape` (elastic/parallel/shape.py) says what its state looks like.
"""
from __future__ import annotations

from dataclasses import dataclass

from elastic.config import FailureConfig
from elastic.parallel.shape import Shape
from elastic.parallel.topology import Layout, slot_sources


@dataclass(frozen=True)
class FromPeer:
    src_rank: int
    step: int
    slot_sources: tuple[int, ...] = ()  # several slots (stages, tp): per slot, the replica its ranks copy


@dataclass(frozen=True)
class FromStorage:
    max_step: int | None = None  # a rollback: the newest committed checkpoint at or before this step


@dataclass(frozen=True)
class FromShards:
    """Re-shard in memory from every old rank's offered part (object refs by old rank), or, after
    a fault (`copies_step`), from the in-memory copies of that step, rank to rank."""
    offers: dict
    old_world: int
    step: int
    old_pp: int = 1  # a pipeline re-partitioned from this many stages (offers by name, rank = old stage)
    copies_step: int | None = None  # the members keep the parts (group.keep_copies): no offers


RestoreSource = FromPeer | FromStorage | FromShards




def choose_restore(survivor_steps: dict[int, int], cfg: FailureConfig,
                   sharded: bool = False, layout: Layout | None = None,
                   private: bool = False) -> tuple[RestoreSource, str]:
    """Memory first: a surviving replica that finished the newest step holds exact state (its
    gradient all-reduce completed, so it includes every rank's contribution). Storage when no
    replica survived, when the state is sharded (a lost rank's shards existed only in its
    memory), when each rank holds state of its own (`private`: gradient compression's error
    feedback), or when the user asked for storage. A layout of several slots (pipeline stages,
    tensor slices, HSDP's shards) needs a surviving replica of every slot at that step."""
    if not cfg.peer_restore:
        return FromStorage(), "failure.peer_restore is off: restore from the latest committed checkpoint"
    if sharded:
        return FromStorage(), ("fully sharded state: the lost rank's shards existed only in its memory; "
                               "restore from the latest committed checkpoint, re-sharded on load")
    if private:
        return FromStorage(), ("train.grad_compression keeps each rank's error feedback in that rank's "
                               "memory alone: every rank restores the latest committed checkpoint, "
                               "which holds every rank's")
    if not survivor_steps:
        return FromStorage(), "no surviving replica holds state in memory: restore from the latest committed checkpoint"
    step = max(survivor_steps.values())
    if layout is not None and layout.slots > 1:
        sources = slot_sources(layout, {r: r for r in survivor_steps}, layout, survivor_steps)
        what = ("shard (HSDP)" if layout.shards > 1 and layout.tp == 1 else
                "slot (shard x tensor slice)" if layout.shards > 1 else
                "stage" if layout.tp == 1 else "slot (stage x tensor slice)")
        if sources is None:
            held = sorted({layout.slot_of(r) for r, s in survivor_steps.items() if s == step})
            return FromStorage(), (f"no surviving replica holds every {what} at step {step} (held: {held} of "
                                   f"{layout.slots}); every rank restores the latest committed checkpoint")
        return FromPeer(sources[0], step, sources), (f"every {what} from a surviving replica's memory (ranks "
                                                     f"{list(sources)}, step {step}), no storage read")
    src = min(r for r, s in survivor_steps.items() if s == step)
    return FromPeer(src, step), f"state from the memory of rank {src} (step {step}), no storage read"


def planned_restore(shape: Shape, peer_restore: bool, step: int, offers: dict, old_world: int,
                    src_rank: int = 0, old_layout: Layout | None = None,
                    new_layout: Layout | None = None, swapped: int | None = None) -> RestoreSource:
    """How state reaches the new group after a planned stop (every old rank alive, all at the
    same step): rank `src_rank`'s broadcast (a replica holds it all), a re-shard of every rank's
    offered part (sharded), or, with failure.peer_restore off, the checkpoint taken at the stop.
    A staged layout that keeps its slots copies each slot from replica 0 (ranks 0..slots-1, which
    keep their numbers); one re-partitioned moves every unit's state by name (without tensor
    parallelism: with it, from the checkpoint taken at the stop). A swap (`swapped`: the rank
    replaced, every other rank alive) copies each slot from a replica other than that rank."""
    if not peer_restore:
        return FromStorage()
    if shape.sharded:  # every old rank's part, re-sharded (fsdp x tp: each tp slice over dp)
        return FromShards(offers, old_world, step)
    if shape.staged and old_layout is not None:
        if old_layout.slots == new_layout.slots:
            sources = tuple(next(new_layout.rank_of(d, s) for d in range(new_layout.dp)
                                 if new_layout.rank_of(d, s) != swapped) for s in range(new_layout.slots))
            return FromPeer(sources[0], step, sources)
        return FromShards(offers, old_world, step, old_layout.pp)
    return FromPeer(src_rank, step)


def restore_after_shrink(shape: Shape, plan: RestoreSource, old: Layout, mapping: dict[int, int], new: Layout,
                         survivor_steps: dict[int, int], peer_restore: bool) -> RestoreSource:
    """The restore plan once the survivors are renumbered (`mapping`: old rank -> new rank). A
    replica source keeps its state under its new number. A staged layout re-plans: each stage
    from a survivor that kept it at the newest step; with one replica left and the model
    re-partitioned over fewer stages, the lost stage's layers come from the latest committed
    checkpoint (DCP reads them by name into the new stages)."""
    if isinstance(plan, FromShards):  # in-memory copies by old rank: re-sharded or re-partitioned by name
        return plan
    if shape.staged and not shape.sharded:
        sources = slot_sources(old, mapping, new, survivor_steps) if peer_restore else None
        if sources:
            return FromPeer(sources[0], max(survivor_steps.values()), sources)
        return FromStorage()
    if isinstance(plan, FromPeer):
        return FromPeer(mapping[plan.src_rank], plan.step)
    return plan


def path_of(plan: RestoreSource) -> str:
    """The resize path an event reports: "storage" or "memory"."""
    return "storage" if isinstance(plan, FromStorage) else "memory"


def rollback_target(committed_steps: list[int], bad_steps: list[int]) -> tuple[int, set[int], str]:
    """train.bad_step=rollback, after `bad_steps` made no update in a row: the step to restore, the
    steps whose batches the replay skips, and why.

    A bad step changes neither weights nor optimizer, so every checkpoint up to the last bad step
    holds the last good step's weights: one taken during the bad run qualifies (it has consumed
    some bad batches already). The newest such checkpoint is the target. Only the bad batches are
    skipped (a replay of them would go bad again); the good ones between the checkpoint and the
    first bad step are trained again, exactly as before. With nothing committed the run restarts
    from its initial state, which is then the only state there is."""
    first, last = min(bad_steps), max(bad_steps)
    usable = [s for s in committed_steps if s <= last]
    to_step = max(usable) if usable else 0
    skip = set(range(max(first, to_step + 1), last + 1))
    where = f"the checkpoint of step {to_step}" if usable else "the initial state (nothing committed)"
    what = (f"skipping the batches of steps {min(skip)}..{last}" if skip
            else "every bad batch is behind it already")
    return to_step, skip, f"{len(bad_steps)} bad steps in a row: back to {where}, {what}"
