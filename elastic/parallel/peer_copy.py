"""A replica's state copied to the ranks that lack it, point to point, from every rank that holds it.

What a restore from a peer used to do: concatenate every tensor of one dtype into one flat buffer
(a second copy of the whole state, on every rank), broadcast it from one source to every rank of
the group (survivors that already held it included), and copy it back. Here instead:

* only the ranks that lack the state receive (`holds` is False there: a replacement, a rank at an
  older step); the others already hold the source's state and take no part but sending;
* every holder sends: each tensor is cut into pieces of at most `CHUNK_BYTES`, and each receiver's
  pieces are dealt out to the holders, least-loaded first, so two survivors each send half;
* pieces go straight from the holder's tensors into the receiver's (views of contiguous tensors):
  no staging buffer, so a receiver's peak memory stays one copy of the state (plus one tensor's
  worth for a tensor that is not contiguous).

Every rank of the group calls `copy_state` with the same tensors in the same order (same shapes,
same dtypes: the same model built for the same slot). Holders must hold the same values, which the
caller guarantees: ranks of a dp group at the same step hold the same state (they applied the same
updates; a step's update is applied, and the step counted, only after its collectives completed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

CHUNK_BYTES = 32 * 2 ** 20  # per piece: large enough that per-message costs vanish, small enough to spread


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of tensor `index`, from `sender` to `receiver` (global ranks)."""
    sender: int
    receiver: int
    index: int
    lo: int
    hi: int


@dataclass(frozen=True)
class CopyStats:
    """Who held the state and who received it (global ranks), and what this rank moved."""
    holders: tuple[int, ...]
    receivers: tuple[int, ...]
    sent_bytes: int
    received_bytes: int


def plan_copy(sizes: list[tuple[int, int]], holders: list[int], receivers: list[int],
              chunk_bytes: int = CHUNK_BYTES) -> list[Piece]:
    """Every receiver gets every tensor whole (`sizes`: (elements, bytes per element) per tensor),
    in pieces of at most `chunk_bytes`, each from the holder that has been given the fewest bytes
    for that receiver so far (ties: the first in `holders`). Pure; the same on every rank."""
    if not holders and receivers:
        raise ValueError("no rank holds the state to copy")
    pieces = []
    for j, r in enumerate(receivers):
        # Rotated per receiver: with several receivers, each starts on another holder.
        order = holders[j % len(holders):] + holders[:j % len(holders)]
        load = dict.fromkeys(order, 0)
        for i, (n, elem) in enumerate(sizes):
            step = max(1, chunk_bytes // max(1, elem))
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                s = min(order, key=lambda h: load[h])
                load[s] += (hi - lo) * elem
                pieces.append(Piece(s, r, i, lo, hi))
    return pieces


def copy_state(tensors: list[torch.Tensor], holds: bool, group) -> CopyStats:
    """Make every rank's `tensors` equal to the holders' (ranks of `group` that pass
    `holds=True`), in place, sending only to the ranks that pass False. Collective over `group`:
    one all-gather of who holds, then the pieces (`plan_copy`) as point-to-point sends."""
    ranks = dist.get_process_group_ranks(group)
    device = tensors[0].device if tensors else torch.device("cpu")
    flag = torch.tensor([1 if holds else 0], dtype=torch.int64, device=device)
    flags = [torch.zeros_like(flag) for _ in ranks]
    dist.all_gather(flags, flag, group=group)
    held = [bool(f.item()) for f in flags]
    holders = [r for r, h in zip(ranks, held) if h]
    receivers = [r for r, h in zip(ranks, held) if not h]
    if not holders:
        raise RuntimeError(f"no rank of {ranks} holds the state to copy")
    me = dist.get_rank()
    plan = plan_copy([(t.numel(), t.element_size()) for t in tensors], holders, receivers)
    ops, unpack = [], []
    flat: dict[int, torch.Tensor] = {}
    sent = received = 0
    with torch.no_grad():
        for p in plan:
            if me not in (p.sender, p.receiver):
                continue
            if p.index not in flat:
                t = tensors[p.index]
                if t.is_contiguous():
                    flat[p.index] = t.view(-1)
                elif me == p.sender:
                    flat[p.index] = t.reshape(-1)  # a copy: sent as is
                else:
                    flat[p.index] = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
                    unpack.append(p.index)  # received here, copied into the tensor at the end
            piece = flat[p.index][p.lo:p.hi]
            if me == p.sender:
                ops.append(dist.P2POp(dist.isend, piece, p.receiver, group))
                sent += piece.numel() * piece.element_size()
            else:
                ops.append(dist.P2POp(dist.irecv, piece, p.sender, group))
                received += piece.numel() * piece.element_size()
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for i in unpack:
            tensors[i].copy_(flat[i].view_as(tensors[i]))
    return CopyStats(tuple(holders), tuple(receivers), sent, received)
