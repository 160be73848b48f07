"""Gradient compressors for the data-parallel strategy (train.grad_compression) and their state.

A compressor reduces one of DataParallel's buckets (elastic/parallel/ddp.py): a flat buffer that
already holds this rank's gradients divided by the world size, so the sum over ranks is the
mean. `launch(k)` starts the bucket's first collective (asynchronously, from backward's hooks,
in bucket order on every rank); `finish(k)` waits for it, runs the rest, and leaves the mean's
approximation in the buffer, bit for bit the same on every rank. Every sum over ranks is taken
in rank order or by one gloo/NCCL all-reduce, so a run repeats bit for bit.

State, and why it is split in two:
  * shared: equal on every rank (PowerSGD's Q factors, warm-started from step to step, and its
    step count, which says when compression starts). It joins the strategy's state dict, so it
    travels wherever the model does: checkpoints, a replica's peer copy, a re-shard.
  * own: one rank's error feedback (what it did not send yet). No other rank holds it, so a
    restore that replaces a rank must read it from a checkpoint (elastic/policies/restore.py).
Updates of a step are held aside until every bucket of the step has been reduced (`commit`):
a step that a lost peer cuts short leaves the state as it was, and is redone from it.

Orders of the arithmetic follow torch.distributed.algorithms.ddp_comm_hooks (bf16_compress_hook,
powerSGD_hook with warm start and error feedback); top-k with error feedback is our own.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class Compressor:
    """No state, nothing to commit: the base of every mode."""

    mode = "none"
    private = False  # True: `own_state` holds what exists on this rank only

    def setup(self, bufs: list[torch.Tensor], shapes: list[list[torch.Size]], group) -> None:
        """Once per bucket layout: the buckets' buffers and, per bucket, its tensors' shapes."""
        self.bufs, self.shapes, self.group = bufs, shapes, group
        self.world = dist.get_world_size(group)
        self.scale = 1.0 / self.world

    def launch(self, k: int):
        raise NotImplementedError

    def finish(self, k: int, pending) -> None:
        raise NotImplementedError

    def commit(self) -> None:
        """Every bucket of the step is reduced: its updates become the state."""

    def discard(self) -> None:
        """A step begins: updates of a step that did not finish are dropped."""

    def shared_state(self) -> dict[str, torch.Tensor]:
        return {}

    def own_state(self) -> dict[str, torch.Tensor]:
        return {}


class Bf16(Compressor):
    """Each bucket cast to bfloat16, all-reduced, cast back: half the bytes, no state."""

    mode = "bf16"

    def launch(self, k: int):
        half = self.bufs[k].to(torch.bfloat16)
        return dist.all_reduce(half, group=self.group, async_op=True), half

    def finish(self, k: int, pending) -> None:
        work, half = pending
        work.wait()
        self.bufs[k].copy_(half)


class _ErrorFeedback(Compressor):
    """A residual per bucket, in the buffer's units (gradient / world size), zero at first."""

    private = True

    def setup(self, bufs, shapes, group) -> None:
        super().setup(bufs, shapes, group)
        self.residual = [torch.zeros_like(b) for b in bufs]
        self._next_residual: dict[int, torch.Tensor] = {}

    def discard(self) -> None:
        self._next_residual = {}

    def commit(self) -> None:
        for k, r in self._next_residual.items():
            self.residual[k] = r
        self._next_residual = {}

    def own_state(self) -> dict[str, torch.Tensor]:
        return {f"residual{k}": r for k, r in enumerate(self.residual)}


class TopK(_ErrorFeedback):
    """Each rank sends the `ratio` largest (by magnitude) of its bucket plus residual, as values
    and int32 indices; every rank all-gathers them and adds them up in rank order; what a rank
    did not send stays in its residual and is added to its next step's bucket."""

    mode = "topk"

    def __init__(self, ratio: float):
        self.ratio = ratio

    def count(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.ratio * numel)))

    def launch(self, k: int):
        acc = self.bufs[k] + self.residual[k]
        values, idx = select(acc, self.count(acc.numel()))
        acc[idx.long()] = 0  # what was sent leaves the residual
        self._next_residual[k] = acc
        all_values = [torch.empty_like(values) for _ in range(self.world)]
        all_idx = [torch.empty_like(idx) for _ in range(self.world)]
        works = (dist.all_gather(all_values, values, group=self.group, async_op=True),
                 dist.all_gather(all_idx, idx, group=self.group, async_op=True))
        return works, all_values, all_idx

    def finish(self, k: int, pending) -> None:
        works, all_values, all_idx = pending
        for w in works:
            w.wait()
        scatter_sum(self.bufs[k], all_values, all_idx)


def select(acc: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` entries of `acc` largest in magnitude, and their int32 indices (4 bytes each,
    not int64's 8: a bucket holds fewer than 2^31 values)."""
    idx = torch.topk(acc.abs(), count, sorted=False).indices
    return acc[idx], idx.to(torch.int32)


def scatter_sum(out: torch.Tensor, all_values: list[torch.Tensor],
                all_idx: list[torch.Tensor]) -> None:
    """Zeros, then each rank's sparse part added in rank order: the same sum on every rank."""
    out.zero_()
    for values, idx in zip(all_values, all_idx):
        out.index_add_(0, idx, values)


class PowerSgd(_ErrorFeedback):
    """torch's PowerSGD (Vogels et al., 2019) per bucket: each matrix M (a tensor of two or more
    dimensions, its first one the rows) that rank-`rank` factors make smaller is sent as P = M Q,
    all-reduced and orthogonalized, then Q = M^T P, all-reduced, and M ~ P Q^T; the bucket's
    other tensors go as they are. Q is warm-started from the step before (shared state); its
    first value is drawn from a generator seeded with the run's seed and the bucket's index.
    The first `start_step` steps are plain fp32 all-reduces without error feedback, as torch's
    start_powerSGD_iter."""

    mode = "powersgd"
    MIN_COMPRESSION_RATE = 2  # as torch's default: a matrix whose factors save less goes whole

    def __init__(self, rank: int, start_step: int, seed: int):
        self.rank, self.start_step, self.seed = rank, start_step, seed

    def setup(self, bufs, shapes, group) -> None:
        super().setup(bufs, shapes, group)
        self.step = torch.zeros((), dtype=torch.int64)
        self._stepped = False
        self.q: list[torch.Tensor] = []
        # Per bucket, per tensor: (offset, rows, cols, offset in Q), or None: sent whole.
        self.plans: list[list[tuple[int, int, int, int] | None]] = []
        for k, bucket_shapes in enumerate(shapes):
            plan, q_size, offset = [], 0, 0
            for shape in bucket_shapes:
                numel = math.prod(shape)
                rows = shape[0] if len(shape) > 1 else 0
                cols = numel // rows if rows else 0
                r = min(self.rank, rows, cols)
                if rows and (rows * cols) >= self.MIN_COMPRESSION_RATE * r * (rows + cols):
                    plan.append((offset, rows, cols, q_size))
                    q_size += cols * r
                else:
                    plan.append(None)
                offset += numel
            self.plans.append(plan)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
            self.q.append(torch.randn(q_size, generator=g, dtype=bufs[k].dtype).to(bufs[k].device))
        self._next_q: dict[int, torch.Tensor] = {}

    def _compressing(self) -> bool:
        return int(self.step) >= self.start_step

    def _matrices(self, k: int, flat: torch.Tensor, q: torch.Tensor):
        """(M, Q) views of each compressed tensor of bucket `k` in `flat` and `q`."""
        for entry in self.plans[k]:
            if entry is not None:
                offset, rows, cols, q_offset = entry
                r = min(self.rank, rows, cols)
                yield (flat[offset:offset + rows * cols].view(rows, cols),
                       q[q_offset:q_offset + cols * r].view(cols, r))

    def _whole(self, k: int, flat: torch.Tensor) -> list[torch.Tensor]:
        offsets = [0]
        for shape in self.shapes[k]:
            offsets.append(offsets[-1] + math.prod(shape))
        return [flat[offsets[i]:offsets[i + 1]] for i, e in enumerate(self.plans[k]) if e is None]

    def launch(self, k: int):
        if not self._compressing():
            return dist.all_reduce(self.bufs[k], group=self.group, async_op=True), None
        acc = self.bufs[k] + self.residual[k]
        ps = [m @ q for m, q in self._matrices(k, acc, self.q[k])]
        p_flat = torch.cat([p.reshape(-1) for p in ps]) if ps else acc.new_zeros(0)
        whole = self._whole(k, acc)
        rest = torch.cat(whole) if whole else acc.new_zeros(0)
        works = (dist.all_reduce(p_flat, group=self.group, async_op=True),
                 dist.all_reduce(rest, group=self.group, async_op=True))
        return works, acc, p_flat, rest

    def finish(self, k: int, pending) -> None:
        self._stepped = True
        works, *held = pending
        if held[0] is None:  # before start_step: a plain all-reduce
            works.wait()
            return
        acc, p_flat, rest = held
        for w in works:
            w.wait()
        out = self.bufs[k]
        q_new = torch.empty_like(self.q[k])
        offset, mats = 0, []
        for m, q in self._matrices(k, acc, q_new):
            p = p_flat[offset:offset + m.shape[0] * q.shape[1]].view(m.shape[0], q.shape[1])
            offset += p.numel()
            orthogonalize(p)
            torch.matmul(m.t(), p, out=q)
            mats.append(p)
        q_work = dist.all_reduce(q_new, group=self.group, async_op=True) if q_new.numel() else None
        if q_work is not None:
            q_work.wait()
        for (o, q), p in zip(self._matrices(k, out, q_new), mats):
            torch.matmul(p, q.t(), out=o)
        start = 0
        for piece in self._whole(k, out):
            piece.copy_(rest[start:start + piece.numel()])
            start += piece.numel()
        # Error feedback as torch's: what this rank meant to send minus its share of what arrived.
        self._next_residual[k] = acc - out * self.scale
        self._next_q[k] = q_new

    def discard(self) -> None:
        super().discard()
        self._next_q = {}
        self._stepped = False

    def commit(self) -> None:
        super().commit()
        for k, q in self._next_q.items():
            self.q[k] = q
        self._next_q = {}
        if self._stepped:
            self.step += 1
        self._stepped = False

    def shared_state(self) -> dict[str, torch.Tensor]:
        return {"step": self.step, **{f"q{k}": q for k, q in enumerate(self.q)}}


def orthogonalize(p: torch.Tensor, eps: float = 1e-8) -> None:
    """Gram-Schmidt on the columns of `p`, in place, as torch's PowerSGD does it."""
    for i in range(p.shape[1]):
        col = p[:, i:i + 1]
        col.div_(col.norm() + eps)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest.sub_(col * (col.t() @ rest))


def make(spec, seed: int) -> Compressor | None:
    """The compressor of train.grad_compression (None: plain fp32 all-reduce)."""
    if spec is None or spec.mode == "none":
        return None
    if spec.mode == "bf16":
        return Bf16()
    if spec.mode == "topk":
        return TopK(spec.topk_ratio)
    return PowerSgd(spec.powersgd_rank, spec.powersgd_start_step, seed)


def load(compressor: Compressor, shared: dict | None, own: dict | None) -> None:
    """Copy saved state into the compressor's tensors (their shapes are the model's)."""
    with torch.no_grad():
        for held, saved in ((compressor.shared_state(), shared), (compressor.own_state(), own)):
            for key, t in (saved or {}).items():
                held[key].copy_(t)
