"""Who keeps whose in-memory copy of sharded state, and which copies a restore can use: pure.

A rank's copy must survive what kills the rank: it goes to a rank on another node (its buddy),
never its own. With several ranks per node the copies of one node's ranks go to ranks of
different nodes where there are enough, so that losing one whole node loses no part together
with its copy, and no rank holds many more copies than another.
"""
from __future__ import annotations

from dataclasses import dataclass

COPIES_PER_RANK = 4  # its own last two parts and one buddy's last two (runtime/memory_copies.KEEP = 2)


@dataclass(frozen=True)
class NodeRoom:
    """What one node can give a run: its name, slots for ranks, and its memory (Ray's view)."""
    name: str
    ranks: int  # how many ranks it can hold (its CPUs or GPUs / a worker's)
    memory_bytes: float


def has_copies(every_steps: int, sharded: bool, pp: int, dp: int, tp: int, shards: int = 1) -> bool:
    """Whether a layout's state needs in-memory copies: it is held once (FSDP's shards, with or
    without tensor slices; the stages of a pipeline with one replica, with or without tensor
    slices; HSDP's `shards` at one replica group). Replicated state has its copy already, in the
    replica (HSDP's other groups)."""
    return bool(every_steps) and ((sharded and pp == 1) or (pp > 1 and dp == 1 and not sharded)
                                  or (shards > 1 and dp == 1))


def choose_buddies(nodes: dict[int, str]) -> tuple[dict[int, int], list[int]]:
    """({rank: buddy rank}, ranks left without one: every other rank shares their node).

    Each rank, in rank order, takes the rank on another node that holds the fewest copies so far,
    preferring a node that holds none of this rank's node's copies yet, then the next rank after
    it (cyclically): a ring across nodes when there is one rank per node."""
    ranks = sorted(nodes)
    held = {r: 0 for r in ranks}
    to_node: dict[str, set[str]] = {}  # node -> nodes that hold copies of its ranks
    buddies, alone = {}, []
    for i, r in enumerate(ranks):
        others = [q for q in ranks[i + 1:] + ranks[:i] if nodes[q] != nodes[r]]
        if not others:
            alone.append(r)
            continue
        used = to_node.setdefault(nodes[r], set())
        b = min(others, key=lambda q: (nodes[q] in used, held[q], others.index(q)))
        buddies[r] = b
        held[b] += 1
        used.add(nodes[b])
    return buddies, alone


def choose_copies(world: int, own: dict[int, tuple[int, ...]], held: dict[int, dict[int, tuple[int, ...]]],
                  committed_step: int | None = None) -> tuple[tuple[int, dict[int, int]] | None, str, bool]:
    """The newest step at which every part of an old group of `world` ranks has an in-memory copy
    that survived: a survivor's own part (`own`: survivor -> steps of its own parts) or a copy at a
    surviving buddy (`held`: survivor -> {rank: steps held for it}). Returns ((step, {old rank:
    the survivor to read it from}), why, False), or (None, why not, lost): lost is True when some
    part has no surviving copy at all, False when the newest committed checkpoint
    (`committed_step`) is newer than the copies (fewer steps redone from storage)."""
    steps = sorted({s for ss in own.values() for s in ss} | {s for h in held.values() for ss in h.values() for s in ss},
                   reverse=True)
    missing: list[int] = list(range(world))
    for step in steps:
        sources: dict[int, int] = {}
        missing = []
        for r in range(world):
            if step in own.get(r, ()):
                sources[r] = r
                continue
            holder = next((h for h in sorted(held) if step in held[h].get(r, ())), None)
            if holder is None:
                missing.append(r)
            else:
                sources[r] = holder
        if not missing:
            if committed_step is not None and committed_step > step:
                return None, (f"the newest complete in-memory copies (step {step}) are older than the latest "
                              f"committed checkpoint (step {committed_step})"), False
            copied = {r: h for r, h in sources.items() if h != r}
            return (step, sources), (f"in-memory copies at step {step}: each survivor's own part, "
                                     f"{', '.join(f'rank {r} from rank {h}' for r, h in sorted(copied.items())) or 'no copy needed'}; "
                                     f"no storage read"), False
    if not steps:
        return None, "no in-memory copies yet (none taken since the last restore, or checkpoint.memory_every_steps is 0)", True
    return None, (f"no step at which every part has a surviving in-memory copy (at step {steps[0]}: none of ranks "
                  f"{missing}, each lost with its buddy or not yet copied)"), True


def copies_room(share_bytes: float, world: int, nodes: list[NodeRoom], max_share: float) -> str | None:
    """Whether in-memory copies fit each node's budget: a node holding k ranks holds about
    k x COPIES_PER_RANK x `share_bytes` (a rank's part of model and optimizer state) of copies,
    which must stay within `max_share` of its memory. None when they fit everywhere; else why not,
    for the first node they do not fit (the caller names the fields)."""
    for node in sorted(nodes, key=lambda n: n.name):
        k = min(world, node.ranks)
        need = k * COPIES_PER_RANK * share_bytes
        if k and need > max_share * node.memory_bytes:
            return (f"in-memory copies need about {need / 2**30:.2f} GiB on node {node.name} ({k} rank(s) x "
                    f"{COPIES_PER_RANK} x {share_bytes / 2**20:.0f} MiB, a rank's share of the model and optimizer "
                    f"state at {world} ranks), over {max_share:g} of its {node.memory_bytes / 2**30:.1f} GiB")
    return None
