"""Re-sharding fully-sharded state to a new world size, in memory.

FSDP2 shards every parameter, and the optimizer state that shares its layout
(Adam's moments), along dim 0 the way `torch.chunk` does: with n rows and W
parts, part i holds rows [min(n, i*c), min(n, (i+1)*c)), c = ceil(n / W).
A resize from W to W' therefore moves row ranges: new part j needs the
intersection of its rows with each old part's rows. `pieces` computes that
(pure); `offer` is what one old rank hands over (its local rows, plus the
replicated tensors and plain values such as Adam's step count and the
param groups); `assemble` fills a freshly sharded state from the offers.

Offers travel through Ray's object store: an old rank returns its offer from
a task, so the object lives in its node's shared memory, owned by the
controller, and outlives the rank's process (a dropped or swapped rank is
killed right after). A receiver reads only the parts it needs. If a part is
missing (its node died), `assemble` raises and the controller falls back to
the newest committed checkpoint, which DCP re-shards on load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
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


def needed_parts(state: dict, old_world: int, new_world: int, new_part: int) -> list[int]:
    """Which old parts new part `new_part` reads, for the row-sharded tensors of `state`."""
    parts = {0}  # part 0 also carries the replicated tensors and plain values
    for _, v in flatten(state):
        if _is_row_sharded(v):
            parts.update(p.old_part for p in pieces(v.shape[0], old_world, new_world, new_part))
    return sorted(parts)


def assemble(state: dict, offers: dict[int, dict], new_world: int, new_part: int) -> int:
    """Fill `state` (this rank's freshly sharded state at `new_world`, same keys as the offers'
    state) in place from `offers` (old part -> offer). Returns the step the offers were taken at."""
    if not offers:
        raise ReshardError("no offers")
    first = next(iter(offers.values()))
    old_world, step = first["world"], first["step"]
    if any(o["world"] != old_world or o["step"] != step for o in offers.values()):
        raise ReshardError(f"offers from different layouts or steps: "
                           f"{sorted((o['part'], o['world'], o['step']) for o in offers.values())}")
    base = offers[min(offers)]
    with torch.no_grad():
        for path, v in flatten(state):
            name = ".".join(map(str, path))
            if _is_row_sharded(v):
                local = v.to_local()
                lo, _ = part_rows(v.shape[0], new_world, new_part)
                for pc in pieces(v.shape[0], old_world, new_world, new_part):
                    if pc.old_part not in offers:
                        raise ReshardError(f"{name}: rows {pc.start}:{pc.stop} were held only by old part "
                                           f"{pc.old_part}, which is gone")
                    src = offers[pc.old_part]["sharded"].get(path)
                    if src is None:
                        raise ReshardError(f"{name}: not in the offer of old part {pc.old_part}")
                    a, _ = part_rows(v.shape[0], old_world, pc.old_part)
                    local[pc.start - lo:pc.stop - lo].copy_(src[pc.start - a:pc.stop - a])
            elif path not in base["other"]:
                raise ReshardError(f"{name}: not in the offers")
            elif isinstance(v, torch.Tensor):
                v.copy_(base["other"][path])
            else:
                _set(state, path, base["other"][path])
    return step
