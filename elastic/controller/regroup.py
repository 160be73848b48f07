"""Gathering a tensor-parallel group split over nodes: a straggler's spare, or a replacement, had
no room beside its tp group, so every layer's all-reduce of that group crosses nodes.

Two ways, cheapest first, each at a step boundary:
* a trade (resize.on_trading): where every replica of a slot holds the same state (DDP x TP, a
  pipeline's or HSDP's replicas), two ranks of one slot in different replicas exchange their
  numbers when that gathers split groups: a renumbering, no process started, no state moved. It
  works where every node is full, and needs two groups split over the same nodes;
* a move onto a spare: once a warm spare waits on a node that holds part of the group (the
  pool's refill is started there, restoring.py), the rank off that node moves to it: a planned
  swap (resize.on_swapping), its state from memory, as a straggler's. Where no node of the group
  has a free slot, spares start on a node with room for all of it (one that joins), and the
  group's ranks move there one by one (group/replacing.py `start_regroup_spares`).

A split is a last resort: a recovery that leaves one names it, with its reason and how it will be
mended (`name_splits`, a `tp_split` event)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from elastic.controller.resize import request_stop
from elastic.controller.states import Swapping, Trading
from elastic.policies.placement import regroup_move, split_groups, trade_move
from elastic.policies.straggler import healthy_compute_s

if TYPE_CHECKING:
    from elastic.controller.controller import Controller


def check(ctl: Controller) -> Trading | Swapping | None:
    """A Trading, or else a Swapping onto a warm spare's node, that gathers a split tp group, with
    the stop at a step boundary requested; None when no group is split or neither can gather
    one. A trade needs replicas holding the same state (not fsdp's shards) and
    failure.peer_restore (its state stays in memory); a move, a slot held by another replica
    or offered at the stop (not one replica of a pipeline or of DDP x TP). With stragglers
    on, the spare must be calibrated within their threshold of the healthy ranks' compute, or,
    where it has nothing to be timed with (kept on the meta device; a pipeline's), be on a node
    no straggler was found on: a node that made a rank slow does not get one of the group back."""
    tp = ctl.job.train.tp.size
    if tp == 1 or not ctl.job.train.tp.regroup:
        return None
    nodes = {r: m.node_id for r, m in ctl.group.members.items()}
    if not split_groups(nodes, tp):
        return None
    if not ctl.shape.sharded and ctl.job.failure.peer_restore:
        trade = trade_move(nodes, tp, ctl.layout.slots)
        if trade is not None:
            return _trade(ctl, trade, nodes)
    if not ctl.shape.swappable(ctl.layout):  # one replica: the rank's slot is in it alone, and nothing offers it
        return None
    ctl.group.refresh_spares()
    healthy = healthy_compute_s(ctl.stragglers, ctl.group.members) if ctl.job.stragglers.enabled else None
    bound = None if healthy is None else ctl.job.stragglers.threshold * healthy
    spares = [(m.node_id, m.calib_s) for m in ctl.group.ready_spares if m.node_id not in ctl.group.suspect_nodes]
    move = regroup_move(nodes, tp, spares, bound, ctl.slow_nodes)
    if move is None:
        return None
    rank, node = move
    timed = bound is None or any(n == node and c is not None and c <= bound for n, c in spares)
    reason = (f"tp group {rank // tp} spans nodes; a warm spare on node {node[:12]} holds the rest of it: "
              f"rank {rank} moves there at the next step boundary")
    if not request_stop(ctl):
        return None
    ctl.events.emit("decision", decision="Regroup", ranks=[rank], reason=reason, step=ctl.step)
    # No bound (stragglers off, or the spare there has no calibration): the swap takes any spare,
    # the one on that node first.
    ctl.swap_healthy_s = healthy if healthy is not None and timed else math.inf
    return Swapping(rank, reason, to_node=node)


def _trade(ctl: Controller, ranks: tuple[int, int], nodes: dict[int, str]) -> Trading | None:
    a, b = ranks
    tp = ctl.job.train.tp.size
    reason = (f"tp groups {sorted({a // tp, b // tp})} span nodes; ranks {a} (node {nodes[a][:12]}) and {b} (node "
              f"{nodes[b][:12]}) hold the same slot's state and exchange their numbers at the next step boundary, "
              f"each joining the other's tp group: no process started, no state moved")
    if not request_stop(ctl):
        return None
    ctl.events.emit("decision", decision="Trade", ranks=[a, b], reason=reason, step=ctl.step)
    return Trading((a, b), reason)


def name_splits(ctl: Controller, replaced: list[int]) -> list[int]:
    """A `tp_split` event for each tp group that spans nodes after `replaced` were filled: its
    ranks, their nodes, why (the group's `split_reasons`) and how it will be gathered. Returns the
    first ranks of those groups."""
    tp = ctl.job.train.tp.size
    nodes = {r: m.node_id for r, m in ctl.group.members.items()}
    split = split_groups(nodes, tp) if tp > 1 else []
    for first in split:
        ranks = [r for r in range(first, first + tp) if r in nodes]
        why = ctl.group.split_reasons.get(first) or ("its survivors were on different nodes before the fault"
                                                     if not set(ranks) & set(replaced) else "no reason recorded")
        ctl.events.emit("tp_split", group=first, ranks=ranks, nodes={r: nodes[r][:12] for r in ranks},
                        reason=why, mend=_mend(ctl))
    return split


def _mend(ctl: Controller) -> str:
    """How a split tp group will be gathered, for the `tp_split` event."""
    if not ctl.job.train.tp.regroup:
        return "not: train.tp.regroup is off"
    if not ctl.shape.swappable(ctl.layout):
        return ("not by a move: at one replica no other rank holds its state (a trade of ranks needs two "
                "replicas too)")
    return ("at a step boundary, from memory: spares start on a node of the group with a free slot, or on a "
            "node with room for all of it (one that joins), and its ranks move there (train.tp.regroup)")
