"""Where the ranks of a tensor-parallel group start: on one node where the cluster allows.

A tp group exchanges activations in every layer (two all-reduces per transformer block), the
chattiest traffic of a step, so its ranks belong on one node's fast links; replicas, which meet
once per step, are spread across nodes, so that losing a node loses whole tp groups whose
replicas survive elsewhere. Pure decisions: the group asks Ray for each node's free CPUs, this
says which node each tp group goes to, and the group starts them there (a soft affinity: Ray may
still move one when the node fills meanwhile).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Placement:
    nodes: dict[int, str | None]  # rank -> node id (None: wherever Ray's SPREAD puts it)
    split: tuple[int, ...] = ()  # first ranks of the tp groups no single node could hold

    def reason(self, tp: int) -> str:
        if not self.split:
            return f"every tp group of {tp} ranks on one node"
        return (f"tp groups starting at ranks {list(self.split)} do not fit on one node (each needs {tp} "
                f"workers' CPUs on one node): their ranks are spread, and their tensor-parallel "
                f"collectives cross nodes")


def place_tp_groups(ranks: list[int], tp: int, free_cpus: dict[str, float], cpus_per_worker: float) -> Placement:
    """Each tp group among `ranks` (ranks r with the same r // tp) on the node with the most free
    CPUs that holds all of it, so groups spread over nodes; a group that fits nowhere is left to
    Ray and named in `split`. Nodes are taken in a fixed order (most free first, then by id)."""
    free = dict(free_cpus)
    groups: dict[int, list[int]] = {}
    for r in sorted(ranks):
        groups.setdefault(r // tp, []).append(r)
    nodes: dict[int, str | None] = {}
    split = []
    for _, members in sorted(groups.items()):
        need = len(members) * cpus_per_worker
        fits = sorted((n for n, c in free.items() if c + 1e-9 >= need), key=lambda n: (-free[n], n))
        if not fits:
            nodes.update({r: None for r in members})
            split.append(members[0])
            continue
        free[fits[0]] -= need
        nodes.update({r: fits[0] for r in members})
    return Placement(nodes, tuple(split))


def split_groups(nodes: dict[int, str], tp: int) -> list[int]:
    """First ranks of the tp groups whose ranks (`nodes`: rank -> node id) span nodes."""
    groups: dict[int, set[str]] = {}
    for r, n in nodes.items():
        groups.setdefault(r // tp, set()).add(n)
    return [g * tp for g, ns in sorted(groups.items()) if len(ns) > 1]


@dataclass(frozen=True)
class Replacements:
    """Where the replacements for lost ranks go (`replacement_homes`)."""
    homes: dict[int, str]  # rank -> the node it belongs on; a rank left out goes wherever a worker is
    split: dict[int, str] = field(default_factory=dict)  # first rank of a tp group -> why it will span nodes
    follow: dict[int, str] = field(default_factory=dict)  # first rank of a tp group -> the node its survivors
    #   move to (a regroup at a step boundary): its own node had no room, that one has room for all of it


def replacement_homes(missing: list[int], tp: int, member_nodes: dict[int, str], spare_nodes: list[str],
                      free_cpus: dict[str, float], cpus_per_worker: float,
                      freed: dict[int, str] | None = None) -> Replacements:
    """Where each replacement for `missing` belongs so its tp group stays on one node. Room on a
    node: a free slot (`free_cpus` / `cpus_per_worker`), the slot of a missing rank's own dead
    process there (`freed`: rank -> its node; Ray may not show it free yet), and a worker already
    there for the taking (`spare_nodes`, one entry per ready spare or worker already starting).
    * Part of a group lost: the node most of its survivors are on, if it has room for the missing
      ranks; else a node with room for the whole group, where the survivors follow (`follow`).
    * A group lost whole: the node with the most room for it; on a tie, the one with the most
      workers already there (a worker started at the fault's first signal is used, not wasted
      beside two started elsewhere), then name order.
    A group that no node can hold together has what room allows placed, the rest left out, and
    says why in `split`. Groups in rank order; a node's room is taken once."""
    room = _slots(free_cpus, cpus_per_worker)
    freed = freed or {}
    for node in set(freed.values()) & set(room):
        room[node] = max(room[node], sum(1 for r in missing if freed.get(r) == node))
    waiting = {n: spare_nodes.count(n) for n in set(spare_nodes)}
    for n, k in waiting.items():
        room[n] = room.get(n, 0) + k
    by_group: dict[int, list[int]] = {}
    for r in sorted(missing):
        by_group.setdefault(r // tp, []).append(r)
    homes: dict[int, str] = {}
    split: dict[int, str] = {}
    follow: dict[int, str] = {}
    for g, ranks in sorted(by_group.items()):
        kept = [r for r in range(g * tp, (g + 1) * tp) if r in member_nodes and r not in ranks]
        home = _majority_node(g, tp, member_nodes, ranks)
        size = len(ranks) + len(kept)
        if home is not None and room.get(home, 0) < len(ranks):
            whole = _roomiest(room, waiting, size, exclude=home)
            if whole is not None and room[whole] >= size:
                follow[g * tp] = whole
                split[g * tp] = (f"node {home[:12]} of its survivors has room for {room.get(home, 0)} of its "
                                 f"{len(ranks)} lost rank(s); node {whole[:12]} has room for all {size}: the "
                                 f"replacement(s) start there and rank(s) {kept} follow at a step boundary")
                home = whole
        if home is None:  # the whole group is gone: the node with the most room for it
            home = _roomiest(room, waiting, len(ranks))
            if home is None:
                split[g * tp] = f"no node has a free slot for its {len(ranks)} rank(s)"
                continue
        for r in ranks:
            if room.get(home, 0) > 0:
                homes[r] = home
                room[home] -= 1
        if any(r not in homes for r in ranks) and g * tp not in split:
            split[g * tp] = (f"no node has room for its {size} ranks together: node {home[:12]} took "
                             f"{sum(1 for r in ranks if r in homes)}, the rest go where a worker is")
    return Replacements(homes, split, follow)


def _roomiest(room: dict[str, int], waiting: dict[str, int], need: int, exclude: str | None = None) -> str | None:
    """The node with the most room for `need` ranks, the most workers already there on a tie,
    then name order; None when no node has room at all."""
    fits = [n for n, k in room.items() if k > 0 and n != exclude]
    return min(fits, key=lambda n: (-min(room[n], need), -min(waiting.get(n, 0), need), n), default=None)


def take_rank(need: list[int], homes: dict[int, str], node: str) -> int | None:
    """Which of the missing ranks `need` (in order) a worker ready on `node` takes: one whose home
    is `node`, else one with no home; never one whose home is another node, however the worker
    was started. (A worker started on demand used to take any rank: one started elsewhere at the
    fault's first signal was ready before the ones starting on the group's node, and took a rank
    of the group, which then spanned two nodes for the rest of the run.)"""
    here = [r for r in need if homes.get(r) == node]
    return (here or [r for r in need if r not in homes] or [None])[0]


def homes_kept(homes: dict[int, str], need: list[int], gone: set[str] | frozenset[str],
               misplaced: set[str] | frozenset[str], waited_s: float, patience_s: float
               ) -> tuple[dict[int, str], dict[int, str]]:
    """The homes of the ranks still missing that are still worth waiting for, and why the others
    were given up (rank -> reason): the node was lost or became suspect (`gone`); a worker started
    there came up on another node (`misplaced`: Ray's soft affinity moved it, the node being gone
    or unable to hold it); or no worker came up there within `patience_s`. A rank given up takes
    any worker: its tp group then spans nodes, which is better than no rank at all."""
    kept: dict[int, str] = {}
    dropped: dict[int, str] = {}
    for r in need:
        h = homes.get(r)
        if h is None:
            continue
        if h in gone:
            dropped[r] = f"its group's node {h[:12]} was lost while its replacement started"
        elif h in misplaced:
            dropped[r] = f"a worker started on node {h[:12]} for its group was placed elsewhere by Ray"
        elif waited_s >= patience_s:
            dropped[r] = f"no worker came up on node {h[:12]} of its group within {patience_s:g} s"
        else:
            kept[r] = h
    return kept, dropped


def spare_homes(n: int, tp: int, free_cpus: dict[str, float], cpus_per_worker: float,
                have: list[str] = ()) -> list[str]:
    """Where `n` new spares start with tensor parallelism: a tp group's worth on one node, so that
    a node kill taking a whole tp group finds a spare for each of its ranks on one node, and the
    replacements keep the group together without a worker started beside a lone spare. A node
    already holding part of a group's worth (`have`: one entry per spare there) is topped up
    first; then the nodes with room for most of a group (name order on ties). Shorter than `n` where
    the nodes lack room: the rest start wherever Ray puts them."""
    room = _slots(free_cpus, cpus_per_worker)
    held = {m: have.count(m) for m in set(have)}
    out: list[str] = []
    for node in sorted((m for m in held if held[m] % tp), key=lambda m: (-(held[m] % tp), m)):
        k = min(tp - held[node] % tp, room.get(node, 0), n - len(out))
        out += [node] * k
        room[node] = room.get(node, 0) - k
    while len(out) < n:
        want = min(tp, n - len(out))
        fits = sorted((m for m, k in room.items() if k > 0), key=lambda m: (-min(room[m], tp), m))
        if not fits:
            break
        k = min(room[fits[0]], want)
        out += [fits[0]] * k
        room[fits[0]] -= k
    return out


def group_node(rank: int, tp: int, member_nodes: dict[int, str]) -> str | None:
    """The node most of `rank`'s tp peers (not `rank` itself) are on: where a replacement for it
    keeps the group whole. None without tensor parallelism, or when no peer is placed."""
    return None if tp == 1 else _majority_node(rank // tp, tp, member_nodes, (rank,))


def _majority_node(group: int, tp: int, member_nodes: dict[int, str], without) -> str | None:
    """The node most members of tp group `group` other than `without` are on (name order breaks
    ties); None when none of them is placed."""
    on = [member_nodes[r] for r in range(group * tp, (group + 1) * tp) if r in member_nodes and r not in without]
    return _most(on, on) if on else None


def _most(on: list[str], among, prefer=frozenset()) -> str:
    """Of the nodes `among`, the one most entries of `on` are; on a tie one in `prefer`, then
    name order."""
    return max(sorted(set(among)), key=lambda n: (on.count(n), n in prefer))


def _slots(free_cpus: dict[str, float], cpus_per_worker: float) -> dict[str, int]:
    """Each node's free worker slots."""
    return {n: int(c / cpus_per_worker + 1e-9) for n, c in free_cpus.items()}


def _split(member_nodes: dict[int, str], tp: int):
    """(ranks, their nodes) of each tp group whose ranks span nodes, in rank order."""
    for first in split_groups(member_nodes, tp):
        ranks = [r for r in range(first, first + tp) if r in member_nodes]
        yield ranks, [member_nodes[r] for r in ranks]


def pick_spare(spares: list[tuple[str, float | None]], max_calib_s: float, home: str | None) -> int | None:
    """Which ready spare (`spares`: (node, calibrated step seconds or None)) takes a straggler's
    rank: one calibrated at most `max_calib_s` (an infinite bound: any, calibrated or not), on
    `home` (its tp group's node) if one is there, else the fastest anywhere (the group then spans
    nodes: said in the `swapped` event). Index, or None when no spare is fast enough."""
    ok = [i for i, (_, c) in enumerate(spares) if max_calib_s == math.inf or (c is not None and c <= max_calib_s)]
    if not ok:
        return None
    return min(ok, key=lambda i: (spares[i][0] != home, spares[i][1] if spares[i][1] is not None else math.inf, i))


def regroup_nodes(member_nodes: dict[int, str], tp: int, free_cpus: dict[str, float],
                  cpus_per_worker: float, prefer: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Where spares belong so that each tp group whose ranks span nodes can be gathered on one:
    for each such group (rank order), the node holding the most of it that has a free worker
    slot (on a tie one in `prefer`: where the group's rank was taken from, a straggler's slot;
    then name order), once per rank of the group off that node. Where no node of its
    own has a free slot, a node with room for all of it (one that joined, or freed up), once per
    rank: the whole group moves there. A node's room is taken once; a group that neither can
    take is left out."""
    room = _slots(free_cpus, cpus_per_worker)
    out: list[str] = []
    for _, on in _split(member_nodes, tp):
        fits = [n for n in on if room.get(n, 0) > 0]
        if not fits:
            whole = _roomiest(room, {}, len(on))
            if whole is not None and room[whole] >= len(on):
                out += [whole] * len(on)
                room[whole] -= len(on)
            continue
        home = _most(on, fits, prefer)
        for _ in range(min(room[home], len(on) - on.count(home))):
            out.append(home)
            room[home] -= 1
    return out


def regroup_move(member_nodes: dict[int, str], tp: int, spares: list[tuple[str, float | None]],
                 max_calib_s: float | None, slow_nodes: frozenset[str] | set[str] = frozenset()
                 ) -> tuple[int, str] | None:
    """The next move that gathers a split tp group: (a rank of the group, the node it moves to),
    where a ready spare usable at that node is on a node already holding part of the group; the
    node holding the most of it first (name order on ties), the group's highest rank off it
    moves. Else, a node none of the group is on with a usable spare for every rank of it (the
    spares `regroup_nodes` started where the group's own nodes had no room): the group's highest
    rank moves there first, and the rest follow, one move each. None when no split group can be
    gathered either way. `spares`: (node, calibrated step seconds or None). Usable: any when
    `max_calib_s` is None (stragglers off); else one calibrated at most `max_calib_s`, or one not
    calibrated (a spare kept on the meta device, a pipeline's: nothing to time it with) on a node
    not in `slow_nodes` (those a straggler was found on)."""
    usable = [n for n, c in spares if max_calib_s is None or (c is not None and c <= max_calib_s)
              or (c is None and n not in slow_nodes)]
    for ranks, on in _split(member_nodes, tp):
        targets = [n for n in on if n in usable]
        if targets:
            home = _most(on, targets)
            return max(r for r in ranks if member_nodes[r] != home), home
        whole = sorted(n for n in set(usable) if usable.count(n) >= len(ranks))
        if whole:
            return max(ranks), whole[0]
    return None


def trade_move(member_nodes: dict[int, str], tp: int, slots: int) -> tuple[int, int] | None:
    """Two ranks of one slot in different replicas (`rank % slots` alike) that exchange their
    numbers so that tp groups split over nodes gather without a spare: where every replica of a
    slot holds the same state (DDP x TP, a pipeline's or HSDP's replicas), each taking the
    other's replica number is a renumbering, and nothing moves. The exchange that leaves the
    fewest ranks off their tp group's node, strictly fewer than now (the lowest ranks on ties);
    None when no exchange does. One of the two is in a split group: the candidates are few."""
    top = max(member_nodes, default=-1)

    def off(g: int, a: int, b: int) -> int:  # ranks of tp group g off its most common node, a and b exchanged
        on = [member_nodes[b if r == a else a if r == b else r] for r in range(g * tp, (g + 1) * tp)
              if r in member_nodes]
        return len(on) - max(on.count(n) for n in set(on))

    best, best_gain = None, 0
    for first in split_groups(member_nodes, tp):
        for a in (r for r in range(first, first + tp) if r in member_nodes):
            for b in range(a % slots, top + 1, slots):  # the same slot in every replica
                if b not in member_nodes or b // tp == a // tp:
                    continue
                ga, gb = a // tp, b // tp
                gain = off(ga, a, a) + off(gb, a, a) - off(ga, a, b) - off(gb, a, b)
                pair = (min(a, b), max(a, b))
                if gain > best_gain or (gain == best_gain and best is not None and pair < best):
                    best, best_gain = pair, gain
    return best
