"""A step's statistics and what is decided from them on the device, without the host reading them.

`StepStats` names the slots of the one small tensor every rank sums each step (the loss, the
flags the run loop agrees on, the squared gradient norm) and reads its host copy. `StepTensors`
makes that tensor and the update's decision from it on the device: whether the step is bad (a
float flag that torch's fused optimizers take as `found_inf`, so the update is masked without a
read), fp16's loss scale, and the copy to the host that the next step reads. Every tensor a step
needs besides these is made once and kept: a tensor made from host values is a copy from pageable
memory, which synchronises a GPU's stream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# fp16's dynamic loss scaling, as torch's GradScaler.
LOSS_SCALE_INIT, LOSS_SCALE_GROWTH_INTERVAL = 2.0 ** 16, 2000


@dataclass(frozen=True)
class StepStats:
    """One step's statistics, summed over the whole world, as every rank reads them.

    They travel as one tensor in one all-reduce (or riding on the gradients' own reduction, see
    `Strategy.reduce_gradients(extra=...)`): a collective of their own would cost a meeting of the
    ranks per step, and one sum in a fixed order keeps every rank's copy bit-identical. The slots
    below are the only place that knows the tensor's layout."""

    # The slots of the statistics tensor, in its order.
    LOSS = 0  # this rank's loss (sum over the world: divide by strategy.loss_ranks)
    STOP = 1  # 1 on a rank asked to stop (request_stop)
    BUSY = 2  # 1 on a rank whose previous persist still runs
    OWE = 3  # 1 on a rank that owes a checkpoint (a persist failed on storage; its wait is over)
    COPYING = 4  # 1 on a rank whose last in-memory copy is still on its way to its buddy
    GRAD_SUMSQ = 5  # this rank's part of the squared gradient norm (where a step checks gradients)
    USER = 6  # the loss function's own metrics from here on, in name order
    # (elastic/runtime/user_metrics.py); GRAD_SUMSQ is 0.0 where such a step checks no gradients
    # A non-finite loss or gradient needs no slot of its own: a sum is finite only if every term
    # is (the squared norms are never negative; +inf and -inf losses sum to NaN), so the summed
    # LOSS and GRAD_SUMSQ tell it. (A sum of finite losses that overflows counts as non-finite:
    # such a step is not one to apply.)

    loss_sum: float
    stop: bool  # some rank was asked to stop: every rank stops after this step
    persist_busy: bool  # some rank's persist still runs: every rank skips a checkpoint due now
    bad_loss: bool
    bad_grads: bool
    owe: bool  # some rank owes a checkpoint: every rank saves again after this step
    copying: bool = False  # some rank's in-memory copy is on its way: every rank skips one due now
    grad_sumsq: float = 0.0  # the GRAD_SUMSQ slot as summed
    user: tuple[float, ...] = ()  # the USER slots as summed (divide by strategy.loss_ranks)

    @classmethod
    def read(cls, host: torch.Tensor) -> StepStats:
        """The summed tensor's host copy, by name."""
        v = host.tolist()
        sumsq = v[cls.GRAD_SUMSQ] if len(v) > cls.GRAD_SUMSQ else 0.0
        return cls(loss_sum=v[cls.LOSS], stop=v[cls.STOP] > 0, persist_busy=v[cls.BUSY] > 0,
                   bad_loss=not math.isfinite(v[cls.LOSS]), bad_grads=not math.isfinite(sumsq),
                   owe=v[cls.OWE] > 0, copying=v[cls.COPYING] > 0, grad_sumsq=sumsq,
                   user=tuple(v[cls.USER:]))

    @classmethod
    def none(cls) -> StepStats:
        """No statistics read yet (a run's first step, read late): nothing agreed."""
        return cls(0.0, False, False, False, False, False)

    def grad_norm(self, copies: int) -> float:
        """The global gradient norm from the summed squares (over `copies` copies of each
        element), in float32 as the device computes the one clipping uses."""
        return float(np.sqrt(np.float32(self.grad_sumsq) / np.float32(copies)))


class StepTensors:
    """The small device tensors of one rank's steps, made once (per device, per shape) and kept."""

    def __init__(self):
        self._flags: dict[tuple, torch.Tensor] = {}
        self._zeros: dict[tuple, torch.Tensor] = {}
        self._found: dict[torch.device, torch.Tensor] = {}
        self._host: dict[int, torch.Tensor] = {}
        self._weights: dict[tuple, torch.Tensor] = {}

    def flags(self, loss: torch.Tensor, stop: bool, busy: bool, owe: bool,
              copying: bool) -> torch.Tensor:
        """Slots LOSS to COPYING, what is known before the gradients are: the loss beside the
        flags, in one kernel. The flags' row is made on the device, once per combination (all
        off, every steady step): from a Python list it would be a copy from pageable memory."""
        key = (loss.device, stop, busy, owe, copying)
        row = self._flags.get(key)
        if row is None:
            row = torch.zeros(StepStats.GRAD_SUMSQ - 1, device=loss.device)
            for i, on in enumerate((stop, busy, owe, copying)):
                if on:
                    row[i] = 1.0
            self._flags[key] = row
        return torch.cat([loss.reshape(1), row])

    def with_user(self, flags: torch.Tensor, user: torch.Tensor) -> torch.Tensor:
        """`flags`, a GRAD_SUMSQ slot of 0.0 and the USER slots: all known before the gradients
        are, so they can ride on the gradients' reduction as the flags do."""
        zero = self._zeros.get((flags.device, 1))
        if zero is None:
            zero = self._zeros[(flags.device, 1)] = torch.zeros(1, device=flags.device)
        return torch.cat([flags, zero, user])

    @staticmethod
    def with_sumsq(flags: torch.Tensor, sumsq: torch.Tensor) -> torch.Tensor:
        """The statistics of a step that checks its gradients: `flags` and GRAD_SUMSQ (written
        into the slot `with_user` left, in place: that tensor is the step's own)."""
        if flags.numel() > StepStats.GRAD_SUMSQ:
            flags[StepStats.GRAD_SUMSQ:StepStats.USER].copy_(sumsq.reshape(1))
            return flags
        return torch.cat([flags, sumsq.reshape(1)])

    def found(self, stats: torch.Tensor) -> torch.Tensor:
        """1.0 if the summed loss or squared gradient norm is not finite, else 0.0, on the device,
        as torch's fused optimizers take `found_inf` (a masked update: no step, no state changed).
        Two kernels: a dot with zeros is NaN exactly when a term is not finite (the flags always
        are), then a comparison into a kept float flag. Kept per device: a step's optimizer reads
        it before the next step writes it, in stream order. The USER slots are not looked at: a
        metric of the user's that is not finite says nothing about the update."""
        stats = stats[:StepStats.USER]
        zeros = self._zeros.get((stats.device, stats.numel()))
        if zeros is None:
            zeros = self._zeros[(stats.device, stats.numel())] = torch.zeros_like(stats)
        out = self._found.get(stats.device)
        if out is None:
            out = self._found[stats.device] = torch.zeros((), device=stats.device)
        return torch.ne(torch.dot(stats, zeros), 0, out=out)

    def to_host(self, stats: torch.Tensor):
        """A copy of `stats` on the host that does not wait for the device, and the event that
        says it has landed (None on a CPU). The buffer is kept (pinned on a GPU) and written again
        by the next step, once this one's copy has been read."""
        buf = self._host.get(stats.numel())
        if buf is None:
            buf = self._host[stats.numel()] = torch.empty(stats.numel(), dtype=stats.dtype,
                                                          pin_memory=stats.is_cuda)
        buf.copy_(stats, non_blocking=True)
        if not stats.is_cuda:
            return buf, None
        event = torch.cuda.Event()
        event.record()
        return buf, event

    def weights(self, weights: list[float], device: torch.device) -> torch.Tensor:
        """Tensor parallelism's per-gradient weights of the squared norm, made once."""
        key = (device, tuple(weights))
        t = self._weights.get(key)
        if t is None:
            t = self._weights[key] = torch.tensor(weights, device=device)
        return t

    def sum_of_squares(self, grads: list[torch.Tensor], device: torch.device,
                       weights: list[float] | None = None) -> torch.Tensor:
        """Sum of squares of `grads`, each weighted (tensor parallelism: 1 / its copies in the tp
        group)."""
        if not grads:
            return torch.zeros((), device=device)
        sq = torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2)
        if weights is not None:
            sq = sq * self.weights(weights, sq.device)
        return sq.sum().to(device)


def update_loss_scale(amp: dict[str, torch.Tensor], stats: torch.Tensor) -> None:
    """fp16's dynamic loss scale after a step, on the device, as torch's GradScaler: an overflow
    (non-finite gradients, finite loss) halves it and restarts the count of good steps; a good
    step counts, and every LOSS_SCALE_GROWTH_INTERVAL-th doubles it; a non-finite loss changes
    neither (a bad step, train.bad_step's to judge). `stats`: the summed statistics with
    GRAD_SUMSQ."""
    bad = torch.ne(stats * 0, 0)  # NaN exactly where a sum is not finite
    bad_loss, bad_grads = bad[StepStats.LOSS], bad[StepStats.GRAD_SUMSQ]
    overflow = bad_grads & ~bad_loss
    counted = amp["good_steps"] + ~(bad_grads | bad_loss)
    grow = counted >= LOSS_SCALE_GROWTH_INTERVAL
    amp["scale"].mul_(torch.where(overflow, 0.5, torch.where(grow, 2.0, 1.0)))
    amp["good_steps"].copy_(torch.where(overflow | grow, 0, counted))
