"""One rank's tensors broadcast into every rank's, in place, in bounded memory.

Used where every rank must take one rank's values: the initial weights of a fresh start (rank 0's
init), and a replica's state on a GPU (`copy_from_replica`; on gloo the point-to-point copy of
peer_copy.py is used instead). It used to concatenate every tensor of a dtype into one flat buffer
and broadcast that: a second copy of the whole model (or model and optimizer) at the peak, on
every rank. Measured on an H100 (docs/benchmarks/gpu.md): an eager FSDP build of 340.8 M parameters
peaked at 2,612 MiB of GPU memory for 1,300 MiB of weights. Here instead:

* a tensor that lives on the group's device, contiguous and at least `chunk_bytes / 8`, is
  broadcast in place: no copy at all;
* the rest (small tensors, non-contiguous ones, and host tensors in an NCCL group, as FSDP's CPU
  offload keeps them) are packed, per dtype, into staging buffers of at most `chunk_bytes` on the
  group's device; a tensor larger than that is cut across several.

So the peak is the state plus one staging buffer. Every rank calls it with the same tensors (same
shapes, dtypes and devices: the same model built for the same slot), so every rank makes the same
plan (`plan_broadcast`, pure) and the broadcasts match.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

CHUNK_BYTES = 64 * 2 ** 20


@dataclass(frozen=True)
class Segment:
    """Elements [lo, hi) of tensor `index`'s flat view."""
    index: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Batch:
    """One broadcast: tensor `segments[0].index` itself (`direct`), or the segments packed, in
    order, into one staging buffer."""
    direct: bool
    segments: tuple[Segment, ...]


def plan_broadcast(sizes: list[tuple[int, int, str, bool]], chunk_bytes: int = CHUNK_BYTES) -> list[Batch]:
    """The broadcasts for tensors of `sizes`: (elements, bytes per element, dtype, on the group's
    device and contiguous) each. Direct for a tensor on the device of at least chunk_bytes / 8;
    the others packed per dtype (dtypes in sorted order, tensors in their order) into batches of
    at most chunk_bytes. Pure."""
    batches = [Batch(True, (Segment(i, 0, n),)) for i, (n, elem, _, here) in enumerate(sizes)
               if here and n * elem >= chunk_bytes // 8 and n > 0]
    direct = {b.segments[0].index for b in batches}
    for dtype in sorted({d for _, _, d, _ in sizes}):
        members = [i for i, (n, _, d, _) in enumerate(sizes) if d == dtype and i not in direct and n > 0]
        if not members:
            continue
        cap = max(1, chunk_bytes // sizes[members[0]][1])  # elements per staging buffer
        current, used = [], 0
        for i in members:
            lo, n = 0, sizes[i][0]
            while lo < n:
                take = min(n - lo, cap - used)
                current.append(Segment(i, lo, lo + take))
                used += take
                lo += take
                if used == cap:
                    batches.append(Batch(False, tuple(current)))
                    current, used = [], 0
        if current:
            batches.append(Batch(False, tuple(current)))
    return batches


def group_device(group, tensors: list[torch.Tensor]) -> torch.device:
    """Where a broadcast over `group` runs: the current GPU for NCCL, else the tensors' device."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return tensors[0].device if tensors else torch.device("cpu")


def broadcast_tensors(tensors: list[torch.Tensor], src: int, group, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Copy global rank `src`'s values into every rank's `tensors`, in place. Collective over
    `group`; nothing to do in a group of one."""
    if dist.get_world_size(group) == 1 or not tensors:
        return
    device = group_device(group, tensors)
    sending = dist.get_rank() == src
    flats: dict[int, torch.Tensor] = {}  # each tensor flat: a view, or (not contiguous) a copy

    def flat(i: int) -> torch.Tensor:
        if i not in flats:
            flats[i] = tensors[i].reshape(-1)
        return flats[i]

    sizes = [(t.numel(), t.element_size(), str(t.dtype), t.device == device and t.is_contiguous()) for t in tensors]
    with torch.no_grad():
        for batch in plan_broadcast(sizes, chunk_bytes):
            if batch.direct:
                dist.broadcast(tensors[batch.segments[0].index], src=src, group=group)
                continue
            n = sum(s.hi - s.lo for s in batch.segments)
            buf = torch.empty(n, dtype=tensors[batch.segments[0].index].dtype, device=device)
            offset = 0
            if sending:
                for s in batch.segments:
                    buf[offset:offset + s.hi - s.lo].copy_(flat(s.index)[s.lo:s.hi])
                    offset += s.hi - s.lo
            dist.broadcast(buf, src=src, group=group)
            if not sending:
                for s in batch.segments:
                    flat(s.index)[s.lo:s.hi].copy_(buf[offset:offset + s.hi - s.lo])
                    offset += s.hi - s.lo
        for i, f in flats.items():
            if not tensors[i].is_contiguous() and not sending:
                tensors[i].copy_(f.view_as(tensors[i]))
