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
`exchange` moves the rows rank to rank over the new group (gloo send/recv, the process group's
transport); after a fault the same way, each survivor keeping its own in-memory copy and those it
holds for its buddies. With tensor parallelism (FSDP x TP: 2-D DTensors on a
("dp", "tp") mesh) each tp slice is re-sharded on its own: the rows the dp parts split are those
of the slice's local tensor, and rows move only between ranks of the same tp index (rank =
dp index x tp + tp index; tp is fixed for a run). HSDP at one replica group is held once too:
its "shard" axis splits the rows as "dp" does FSDP's (its "dp" axis has size 1). An old rank
that leaves (a dropped or swapped rank, killed right after) returns its offer from a task
instead, so the object lives in its node's shared memory, owned by the controller, and outlives
the rank's process; a receiver reads only the parts it needs. If a part is missing (its
node died), the re-shard raises and the controller falls back to the newest
committed checkpoint, which DCP re-shards on load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


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


def set_leaf(tree, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


@dataclass(frozen=True)
class Rows:
    """How the dp axis splits one DTensor: `n` rows (of this rank's tp slice: with a tp split
    along dim 0, the slice's rows), in `parts` parts by the chunk rule; this rank holds `part`."""
    n: int
    parts: int
    part: int


def rows(v) -> Rows | None:
    """The dp split of `v` when it is a DTensor sharded along dim 0 over the mesh's "dp" axis
    (FSDP2's shards, 1-D or with a tp axis beside it), or over its "shard" axis at one HSDP
    replica group (the "dp" axis of size 1: the state is held once, like FSDP's); None for
    anything else that is not a DTensor or is a scalar. ReshardError for a DTensor laid out some
    other way."""
    if not isinstance(v, DTensor) or v.ndim == 0:
        return None
    mesh, placements = v.device_mesh, tuple(v.placements)
    names = mesh.mesh_dim_names or ()
    coord = mesh.get_coordinate()
    by = dict(zip(names, zip(placements, coord, mesh.shape)))
    if set(names) - {"dp", "shard", "tp"} or "dp" not in by:
        raise ReshardError(f"placement {placements} on mesh {names}: not sharded over a dp axis")
    if "shard" in by:  # HSDP: held once only at one replica group, where the shard axis splits it
        if by["dp"][2] != 1:
            raise ReshardError(f"placement {placements} on mesh {names}: HSDP with {by['dp'][2]} replica groups "
                               f"(each group's ranks at a shard hold it; it is copied, not re-sharded)")
        by["dp"] = by.pop("shard")
    dp, tp = by["dp"], by.get("tp")
    n = v.shape[0]
    row_split_by_tp = tp is not None and isinstance(tp[0], Shard) and tp[0].dim == 0
    if tp is not None and not isinstance(tp[0], (Shard, Replicate)):
        raise ReshardError(f"placement {placements}: tp placement {tp[0]} is not Shard or Replicate")
    if row_split_by_tp:
        # FSDP2 shards a tp slice's local rows: dp's placement says so (a strided shard, split by tp).
        if not (isinstance(dp[0], _StridedShard) and dp[0].dim == 0 and dp[0].split_factor == tp[2]):
            raise ReshardError(f"placement {placements}: rows split by tp but not by a strided dp shard")
        a, b = part_rows(n, tp[2], tp[1])
        n = b - a
    elif type(dp[0]) is not Shard or dp[0].dim != 0:
        raise ReshardError(f"placement {placements}: dp placement {dp[0]} is not Shard(0)")
    return Rows(n, dp[2], dp[1])


def copy_into(v: torch.Tensor, into) -> torch.Tensor:
    """A CPU copy of `v`: into `into` (an older copy of the same tensor, reused) when its dtype and
    shape match, else a new tensor. Reusing spares the fresh pages a large copy faults in (a
    copy every step of a 600 MB part: seconds of page faults a minute on CPUs)."""
    if isinstance(into, torch.Tensor) and into.dtype == v.dtype and into.shape == v.shape and into.is_contiguous():
        return into.copy_(v.detach())
    return v.detach().to("cpu", copy=True)


def offer(state: dict, part: int, world: int, step: int, tp: int = 1, into: dict | None = None) -> dict:
    """What old rank `part` of `world` hands over: its local rows of every dp-sharded tensor
    (checked against the chunk rule and the rank order dp index x `tp` + tp index), every other
    tensor and every plain value. CPU copies (into `into`'s tensors, an older offer of the same
    rank no longer needed, where they match)."""
    old_sharded, old_other = (into or {}).get("sharded", {}), (into or {}).get("other", {})
    sharded, other = {}, {}
    for path, v in flatten(state):
        r = rows(v)
        if r is not None:
            local = v.to_local()
            a, b = part_rows(r.n, r.parts, r.part)
            if local.shape[0] != b - a or r.parts * tp != world or r.part != part // tp:
                raise ReshardError(f"{'.'.join(map(str, path))}: local rows {local.shape[0]} on dp part "
                                   f"{r.part}/{r.parts} (rank {part}/{world}, tp {tp}) do not follow the chunk "
                                   f"layout ({b - a} expected)")
            sharded[path] = copy_into(local, old_sharded.get(path))
        elif isinstance(v, DTensor):
            raise ReshardError(f"{'.'.join(map(str, path))}: a DTensor scalar ({v.placements}) is not re-sharded")
        elif isinstance(v, torch.Tensor):
            other[path] = copy_into(v, old_other.get(path))
        else:
            other[path] = v
    return {"part": part, "world": world, "step": step, "sharded": sharded, "other": other}


def needed_parts(state: dict, old_world: int, new_world: int, new_part: int, held: frozenset = frozenset(),
                 tp: int = 1) -> list[int]:
    """Which old parts (old ranks) new part `new_part` reads from the object store, for the
    dp-sharded tensors of `state`: those of its tp index whose rows overlap its own, less the
    `held` ones (moved rank to rank)."""
    parts = {0}  # part 0 also carries the replicated tensors and plain values
    t = new_part % tp
    for _, v in flatten(state):
        r = rows(v)
        if r is not None:
            parts.update(p.old_part * tp + t for p in pieces(r.n, old_world // tp, new_world // tp, r.part))
    return sorted(parts - set(held))


@dataclass(frozen=True)
class Exchanged:
    step: int  # the step the offers were taken at
    received_bytes: int  # rows this rank received rank to rank


def exchange(state: dict, kept: dict[int, dict], fetched: dict[int, dict], holders: dict[int, int], old_world: int,
             new_world: int, new_part: int, group, tp: int = 1) -> Exchanged:
    """Fill `state` (this rank's freshly sharded state at `new_world`, same keys as the offers')
    in place. The parts in `holders` (old part -> the new rank that kept it in memory) move rank
    to rank over `group` (gloo: CPU tensors, whatever the training backend); `kept` holds the
    parts this rank keeps (old part -> offer: its own at a planned resize; after a fault, its own
    in-memory copy and those it holds as a buddy). The other needed parts are in `fetched` (old
    part -> offer, read from the object store); with no holders, `group` is not used. Collective: every rank of the
    new group calls it with the same holders, and walks the same tensors and pieces in the same
    order, so each send meets its receive. With `tp` > 1, rows move between ranks of the same tp
    index only (a holder keeps its tp index). Returns the step the offers were taken at and the
    bytes this rank received rank to rank."""
    held = set(holders)
    if 0 not in held and 0 not in fetched:
        raise ReshardError("no offer of part 0 (it carries the replicated tensors and the step)")
    if any(holders.get(p) != new_part for p in kept) or any(
            r == new_part and p not in kept for p, r in holders.items()):
        raise ReshardError(f"rank {new_part} keeps old parts {sorted(kept)}, but holders say {holders}")
    if any(old % tp != new % tp for old, new in holders.items()):
        raise ReshardError(f"holders {holders} move rows across tp indices (tp {tp})")
    # The replicated tensors, plain values and step travel with part 0.
    if 0 in held:
        box = [(kept[0]["other"], kept[0]["step"], kept[0]["world"]) if holders[0] == new_part else None]
        dist.broadcast_object_list(box, src=holders[0], group=group)
        other, step, world = box[0]
    else:
        other, step, world = fetched[0]["other"], fetched[0]["step"], fetched[0]["world"]
    if world != old_world or any(o["world"] != old_world or o["step"] != step
                                 for o in (*fetched.values(), *kept.values())):
        raise ReshardError(f"offers from different layouts or steps: world {world}/{old_world}, step {step}, "
                           f"fetched {sorted((o['part'], o['world'], o['step']) for o in fetched.values())}, "
                           f"kept {sorted((o['part'], o['world'], o['step']) for o in kept.values())}")
    t, old_dp, new_dp = new_part % tp, old_world // tp, new_world // tp
    received = 0
    with torch.no_grad():
        for path, v in flatten(state):
            name = ".".join(map(str, path))
            r = rows(v)
            if r is None:
                if path not in other:
                    raise ReshardError(f"{name}: not in the offers")
                if isinstance(v, torch.Tensor):
                    v.copy_(other[path])
                else:
                    set_leaf(state, path, other[path])
                continue
            if r.parts != new_dp or r.part != new_part // tp:
                raise ReshardError(f"{name}: dp part {r.part}/{r.parts} at rank {new_part}/{new_world}, tp {tp}")
            local = v.to_local()
            lo, _ = part_rows(r.n, new_dp, r.part)
            pending, landing = [], []
            for dst_dp in range(new_dp):
                dst = dst_dp * tp + t
                for pc in pieces(r.n, old_dp, new_dp, dst_dp):
                    src = pc.old_part * tp + t  # the old rank: same tp index
                    a, _ = part_rows(r.n, old_dp, pc.old_part)
                    holder = holders.get(src)
                    if holder is None:  # from the object store, read by the receiver alone
                        if dst == new_part:
                            if src not in fetched:
                                raise ReshardError(f"{name}: rows {pc.start}:{pc.stop} were held only by old part "
                                                   f"{src}, which is gone")
                            local[pc.start - lo:pc.stop - lo].copy_(fetched[src]["sharded"][path][
                                pc.start - a:pc.stop - a])
                    elif holder == new_part and dst == new_part:
                        local[pc.start - lo:pc.stop - lo].copy_(kept[src]["sharded"][path][pc.start - a:pc.stop - a])
                    elif holder == new_part:
                        pending.append(dist.isend(kept[src]["sharded"][path][pc.start - a:pc.stop - a].contiguous(),
                                                  dst=dst, group=group))
                    elif dst == new_part:
                        into = local[pc.start - lo:pc.stop - lo]
                        # gloo receives into contiguous CPU memory; anything else lands in a buffer first.
                        buf = into if into.is_contiguous() and into.device.type == "cpu" else torch.empty(
                            into.shape, dtype=into.dtype)
                        pending.append(dist.irecv(buf, src=holder, group=group))
                        received += buf.numel() * buf.element_size()
                        if buf is not into:
                            landing.append((into, buf))
            for work in pending:
                work.wait()
            for into, buf in landing:
                into.copy_(buf)
    return Exchanged(step, received)
