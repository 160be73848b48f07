"""Re-sharding fully-sharded state to a new world size, in memory.

FSDP2 shards every parameter, and the optimizer state that shares its layout
(Adam's moments), along dim 0 the way `torch.chunk` does: with n rows and W
parts, part i holds rows [min(n, i*c), min(n, (i+1)*c)), c = ceil(n / W).
A resize from W to W' therefore moves row ranges: new part j needs the
intersection of its rows with each old part's rows. `pieces` computes that
(pure); `offer` is what one old rank hands over (its local rows, plus the
replicated tensors and plain values such as Adam's step count and the
param groups); `exchange` fills a freshly sharded state from the offers.

An old rank that stays in the new group keeps its offer in its own memory, and
`exchange` moves the rows rank to rank over the new group (gloo send/recv, the
process group's transport). An old rank that leaves (a dropped or swapped rank,
killed right after) returns its offer from a task instead, so the object lives
in its node's shared memory, owned by the controller, and outlives the rank's
process; a receiver reads only the parts it needs. If a part is missing (its
node died), the re-shard raises and the controller falls back to the newest
committed checkpoint, which DCP re-shards on load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


class ReshardError(RuntimeError):
    """The offers do not hold everything the new layout needs."""


def part_rows(n: int, world: int, part: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 that part `part` of `world` holds (torch.chunk's split)."""
    c = -(-n // world) if n else 0
    return min(n, part * c), min(n, (part + 1) * c)


@dataclass(frozen=True)
class Piece:
    old_part: int
    start: int  # global rows [start, stop)
    stop: int


def pieces(n: int, old_world: int, new_world: int, new_part: int) -> list[Piece]:
    """The row ranges new part `new_part` needs, and which old part holds each: they tile the
    new part's rows exactly, in order."""
    lo, hi = part_rows(n, new_world, new_part)
    out = []
    for p in range(old_world):
        a, b = part_rows(n, old_world, p)
        s, e = max(a, lo), min(b, hi)
        if s < e:
            out.append(Piece(p, s, e))
    return out


def flatten(tree, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    """(path, leaf) pairs of a nested dict/list state, in a fixed order."""
    if isinstance(tree, dict):
        return [kv for k in sorted(tree, key=str) for kv in flatten(tree[k], prefix + (k,))]
    if isinstance(tree, list):
        return [kv for i, v in enumerate(tree) for kv in flatten(v, prefix + (i,))]
    return [(prefix, tree)]


def map_leaves(tree, fn):
    """A nested dict/list state with `fn` applied to every leaf (the same shape, new containers)."""
    if isinstance(tree, dict):
        return {k: map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(v, fn) for v in tree]
    return fn(tree)


def _set(tree, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _is_row_sharded(t) -> bool:
    return isinstance(t, DTensor) and t.ndim > 0 and tuple(t.placements) == (Shard(0),)


def offer(state: dict, part: int, world: int, step: int) -> dict:
    """What old rank `part` of `world` hands over: its local rows of every row-sharded tensor
    (checked against the chunk rule), every other tensor and every plain value. CPU copies."""
    sharded, other = {}, {}
    for path, v in flatten(state):
        if _is_row_sharded(v):
            local = v.to_local()
            a, b = part_rows(v.shape[0], world, part)
            if local.shape[0] != b - a:
                raise ReshardError(f"{'.'.join(map(str, path))}: local rows {local.shape[0]} on part {part}/{world} "
                                   f"do not follow the chunk layout ({b - a} expected)")
            sharded[path] = local.detach().to("cpu", copy=True)
        elif isinstance(v, DTensor):
            raise ReshardError(f"{'.'.join(map(str, path))}: placement {v.placements} is not Shard(0)")
        elif isinstance(v, torch.Tensor):
            other[path] = v.detach().to("cpu", copy=True)
        else:
            other[path] = v
    return {"part": part, "world": world, "step": step, "sharded": sharded, "other": other}


def needed_parts(state: dict, old_world: int, new_world: int, new_part: int, held: frozenset = frozenset()) -> list[int]:
    """Which old parts new part `new_part` reads from the object store, for the row-sharded
    tensors of `state`: those its rows overlap, less the `held` ones (moved rank to rank)."""
    parts = {0}  # part 0 also carries the replicated tensors and plain values
    for _, v in flatten(state):
        if _is_row_sharded(v):
            parts.update(p.old_part for p in pieces(v.shape[0], old_world, new_world, new_part))
    return sorted(parts - set(held))


def exchange(state: dict, own: dict | None, fetched: dict[int, dict], holders: dict[int, int], old_world: int,
             new_world: int, new_part: int, group) -> int:
    """Fill `state` (this rank's freshly sharded state at `new_world`, same keys as the offers')
    in place. The parts in `holders` (old part -> the new rank that kept it in memory) move rank
    to rank over `group` (gloo: CPU tensors, whatever the training backend); `own` is this rank's
    kept offer, if it holds one. The other needed parts are in `fetched` (old part -> offer, read
    from the object store); with no holders, `group` is not used. Collective: every rank of the
    new group calls it with the same holders, and walks the same tensors and pieces in the same
    order, so each send meets its receive. Returns the step the offers were taken at."""
    held = set(holders)
    if 0 not in held and 0 not in fetched:
        raise ReshardError("no offer of part 0 (it carries the replicated tensors and the step)")
    if own is not None and holders.get(own["part"]) != new_part:
        raise ReshardError(f"rank {new_part} holds old part {own['part']}, but holders say {holders}")
    # The replicated tensors, plain values and step travel with part 0.
    if 0 in held:
        box = [(own["other"], own["step"], own["world"]) if holders[0] == new_part else None]
        dist.broadcast_object_list(box, src=holders[0], group=group)
        other, step, world = box[0]
    else:
        other, step, world = fetched[0]["other"], fetched[0]["step"], fetched[0]["world"]
    if world != old_world or any(o["world"] != old_world or o["step"] != step for o in fetched.values()) or (
            own is not None and own["step"] != step):
        raise ReshardError(f"offers from different layouts or steps: world {world}/{old_world}, step {step}, "
                           f"fetched {sorted((o['part'], o['world'], o['step']) for o in fetched.values())}")
    with torch.no_grad():
        for path, v in flatten(state):
            name = ".".join(map(str, path))
            if not _is_row_sharded(v):
                if path not in other:
                    raise ReshardError(f"{name}: not in the offers")
                if isinstance(v, torch.Tensor):
                    v.copy_(other[path])
                else:
                    _set(state, path, other[path])
                continue
            n = v.shape[0]
            local = v.to_local()
            lo, _ = part_rows(n, new_world, new_part)
            pending, landing = [], []
            for dst in range(new_world):
                for pc in pieces(n, old_world, new_world, dst):
                    a, _ = part_rows(n, old_world, pc.old_part)
                    holder = holders.get(pc.old_part)
                    if holder is None:  # from the object store, read by the receiver alone
                        if dst == new_part:
                            if pc.old_part not in fetched:
                                raise ReshardError(f"{name}: rows {pc.start}:{pc.stop} were held only by old part "
                                                   f"{pc.old_part}, which is gone")
                            local[pc.start - lo:pc.stop - lo].copy_(fetched[pc.old_part]["sharded"][path][
                                pc.start - a:pc.stop - a])
                    elif holder == new_part and dst == new_part:
                        local[pc.start - lo:pc.stop - lo].copy_(own["sharded"][path][pc.start - a:pc.stop - a])
                    elif holder == new_part:
                        pending.append(dist.isend(own["sharded"][path][pc.start - a:pc.stop - a].contiguous(),
                                                  dst=dst, group=group))
                    elif dst == new_part:
                        into = local[pc.start - lo:pc.stop - lo]
                        # gloo receives into contiguous CPU memory; anything else lands in a buffer first.
                        buf = into if into.is_contiguous() and into.device.type == "cpu" else torch.empty(
                            into.shape, dtype=into.dtype)
                        pending.append(dist.irecv(buf, src=holder, group=group))
                        if buf is not into:
                            landing.append((into, buf))
            for work in pending:
                work.wait()
            for into, buf in landing:
                into.copy_(buf)
    return step
