"""One training step of one rank: its batches (elastic/runtime/batches.py), forward and backward
through the strategy, the step's statistics summed over the whole world in one collective
(`StepStats`), and the update every rank decides the same way from them (clipping, fp16 loss
scaling, bad steps).

The worker's run loop calls `StepRunner.train_step` once per step and acts on the flags it
returns (a stop, a checkpoint to skip or to save again); the runner keeps what the step reports
(compute times, the sample ledger, skipped steps) until the next poll.
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from elastic.checkpoint.retry import PEER_LOST
from elastic.config import batch_plan
from elastic.parallel.buffers import StepBuffers
from elastic.protocol import LedgerEntry, StepRecord
from elastic.runtime import chaos
from elastic.runtime.batches import RankBatches, to_device
from elastic.runtime.collectives import GroupAborted
from elastic.runtime.compute_clock import ComputeClock, cpu_time_counts

if TYPE_CHECKING:
    from elastic.runtime.worker import Worker


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG seed for one rank's step. RNG state is a function of (seed, step, rank), so a
    restored run draws exactly what the uninterrupted run drew, with nothing extra to save."""
    return (seed * 1_000_003 + step * 7919 + rank) % (2**63)


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, hung past the backstop, or the group was torn down."""


class BadStep(RuntimeError):
    """A step's loss or gradient was not finite and train.bad_step says stop (the user's to fix).
    `step`: the bad step (the rank's own counter has not reached it: it made no update)."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


class RollBack(Exception):
    """train.bad_step=rollback: bad_step_limit bad steps in a row; the controller restores."""

    def __init__(self, bad_steps: list[int]):
        super().__init__(f"bad steps {bad_steps}")
        self.bad_steps = bad_steps


LOSS_SCALE_INIT, LOSS_SCALE_GROWTH_INTERVAL = 2.0 ** 16, 2000  # fp16 dynamic loss scaling, as torch's GradScaler


# A lost peer (as the checkpointer recognises it) or any error raised by the transport itself.
_TRANSPORT_ERRORS = PEER_LOST + ("gloo/transport", "nccl", "process group", "processgroup")


def is_collective_failure(e: BaseException) -> bool:
    """A failure of the group rather than of the user's code. FSDP all-gathers and reduce-scatters
    inside forward and backward, so a peer's death surfaces there, as a plain RuntimeError from
    the transport; it must not be mistaken for a bug in the model (which is never retried)."""
    if isinstance(e, (dist.DistError, GroupAborted)):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(m in text for m in _TRANSPORT_ERRORS)


@dataclass(frozen=True)
class StepStats:
    """One step's statistics, summed over the whole world, as every rank reads them.

    They travel as one tensor in one all-reduce (or riding on the gradients' own reduction, see
    `flags`): a collective of their own would cost a meeting of the ranks per step, and one sum in
    a fixed order keeps every rank's copy bit-identical. The slots below are the only place that
    knows the tensor's layout."""

    # The slots of the statistics tensor, in its order.
    LOSS = 0  # this rank's loss (sum over the world: divide by strategy.loss_ranks)
    STOP = 1  # 1 on a rank asked to stop (request_stop)
    BUSY = 2  # 1 on a rank whose previous persist still runs
    OWE = 3  # 1 on a rank that owes a checkpoint (a persist failed on storage; its wait is over)
    COPYING = 4  # 1 on a rank whose last in-memory copy is still on its way to its buddy
    GRAD_SUMSQ = 5  # this rank's part of the squared gradient norm
    # A non-finite loss or gradient needs no slot of its own: a sum is finite only if every term
    # is (the squared norms are never negative; +inf and -inf losses sum to NaN), so the summed
    # LOSS and GRAD_SUMSQ tell it on the host, and the step launches no isfinite kernels. (A sum
    # of finite losses that overflows counts as non-finite: such a step is not one to apply.)

    loss_sum: float
    stop: bool  # some rank was asked to stop: every rank stops after this step
    persist_busy: bool  # some rank's persist is still in flight: every rank skips a checkpoint due now
    bad_loss: bool
    bad_grads: bool
    owe: bool  # some rank owes a checkpoint: every rank saves again after this step
    copying: bool = False  # some rank's in-memory copy is on its way: every rank skips a copy due now

    @classmethod
    def flags(cls, loss: torch.Tensor, stop: bool, busy: bool, owe: bool, copying: bool) -> torch.Tensor:
        """What is known before the gradients are: slots LOSS to COPYING. A strategy whose
        gradient reduction spans the whole world sums this in place on the same group
        (`Strategy.reduce_gradients(extra=...)`). Made on the loss's device by kernels alone, and
        only the flags that are set cost one: a copy from a Python list would synchronise a GPU's
        stream (PyTorch waits for a copy from pageable memory) and hold the host until backward
        had finished."""
        out = torch.zeros(cls.GRAD_SUMSQ, device=loss.device)
        out[cls.LOSS] = loss
        for slot, on in ((cls.STOP, stop), (cls.BUSY, busy), (cls.OWE, owe), (cls.COPYING, copying)):
            if on:
                out[slot] = 1.0
        return out

    @classmethod
    def tensor(cls, flags: torch.Tensor, sumsq: torch.Tensor) -> torch.Tensor:
        """The whole statistics tensor: `flags` and GRAD_SUMSQ."""
        return torch.cat([flags, sumsq.reshape(1)])

    @classmethod
    def read(cls, host: torch.Tensor) -> StepStats:
        """The summed tensor's host copy, by name."""
        v = host.tolist()
        return cls(loss_sum=v[cls.LOSS], stop=v[cls.STOP] > 0, persist_busy=v[cls.BUSY] > 0,
                   bad_loss=not math.isfinite(v[cls.LOSS]), bad_grads=not math.isfinite(v[cls.GRAD_SUMSQ]),
                   owe=v[cls.OWE] > 0, copying=v[cls.COPYING] > 0)


class StepRunner:
    """Trains one step at a time on the worker's model, optimizer and strategy (`worker`)."""

    def __init__(self, worker: Worker, lock: threading.Lock):
        self.w = worker
        self._lock = lock  # the worker's: poll() drains what the step reports
        self.skip_steps: set[int] = set()  # steps (1-based) to train without an update (after a rollback)
        self._bad_in_a_row: list[int] = []  # consecutive bad steps so far (since the last restore)
        self._buffers = StepBuffers()
        # Reported by the next poll: (step, why) of steps that made no update; per step, the
        # rank's own compute seconds and the global mean loss; the sample ledger, if enabled.
        self.skipped: list[tuple[int, str]] = []
        self.compute_log: list[StepRecord] = []
        self.ledger: list[LedgerEntry] = []
        self.data = RankBatches(worker)  # what the rank reads each step, read ahead
        self._cpu_time = cpu_time_counts(worker.job)  # how the compute is timed (see compute_clock)
        self._slow = chaos.SlowCompute()  # the "slow" fault, if this process is given one
        self.held_report = None  # memory_sync: the last step's report, until its copies are in

    def take(self) -> tuple[tuple[StepRecord, ...], tuple[LedgerEntry, ...], tuple[tuple[int, str], ...]]:
        """(compute log, ledger, skipped steps) since the last take, emptied. The caller holds
        the lock."""
        out = tuple(self.compute_log), tuple(self.ledger), tuple(self.skipped)
        self.compute_log, self.ledger, self.skipped = [], [], []
        return out

    # ---------------------------------------------------------------- the step
    def train_step(self, micro: int) -> StepStats:
        """Step `worker.step + 1`. One that a lost peer cuts short leaves the model's buffers as
        they were before it (elastic/parallel/buffers.py, StepBuffers): it is redone."""
        self._buffers.save(self.w.model)
        try:
            return self._train_step(micro)
        except CollectiveError:
            self._buffers.restore()
            raise

    def _train_step(self, micro: int) -> StepStats:
        """Step `worker.step + 1`: forward, backward, the statistics agreed, the update."""
        w = self.w
        tr = w.job.train
        t_start = time.perf_counter()
        clock = ComputeClock(w.device, self._cpu_time)  # the rank's own work, on a GPU too (see compute_clock)
        clock.start()
        # One seed per slot group: the tp ranks of a slot draw alike (dropout on replicated activations).
        seed = step_seed(w.job.run.seed, w.step, w.rank // w.layout.tp)
        # The CPU generator, and every CUDA device's once CUDA has started in this process (a GPU
        # rank's own; any a CPU rank's code started): all a step draws from. torch.manual_seed
        # would also queue lazy XPU/MTIA seeding (and CUDA's before it starts), formatting the
        # Python stack each time: up to 0.3 ms a step in a Ray actor's deep stack, against 1 us
        # for this (measured on CPU).
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
        # Python's and NumPy's too, for a model or loss that draws from them (about 10 us).
        random.seed(seed)
        np.random.seed(seed % 2**32)
        # The data slice follows the rank's replica (its dp coordinate): every stage of a pipeline
        # replica works on the same samples; ddp and fsdp ranks are each a replica, and HSDP's
        # shards of one replica group read different samples (Layout.data_rank).
        lay = w.layout
        replica = lay.data_rank(w.rank)  # HSDP: each shard of a replica group reads its own share
        idx = w.order.rank_indices(w.step, tr.global_batch_size, lay.data_world, replica)
        w.optimizer.zero_grad(set_to_none=True)
        self.data.prefetch_next(micro)
        stop = bool(w.stop_requested)
        busy = w.ckpt is not None and w.ckpt.in_flight()
        loss_fn = w.fns["stage_loss"] if tr.strategy == "pipeline" else w.fns["loss"]
        scale = w.amp["scale"] if w.amp else None
        if scale is not None:  # fp16: scale the loss so small gradients survive; unscaled below
            loss_fn = _scaled(loss_fn, scale)
        loss_fn = self._slow.wrap(loss_fn, w.slow_factor,
                                  inside=tr.strategy != "pipeline" and w.device.type != "cuda")
        try:
            with torch.autocast(w.device.type, dtype=_AUTOCAST[tr.precision], enabled=tr.precision != "fp32"):
                local_loss = w.strategy.train_step(w.model, idx, self.data.load, loss_fn, micro)
            local_loss = local_loss.float().to(w.device)
        except Exception as e:
            if is_collective_failure(e):
                raise CollectiveError(f"{type(e).__name__}: {e}") from e
            raise
        finally:
            self.data.step_done()
        if scale is not None:
            local_loss = local_loss / scale
        self._slow.finish(w.slow_factor, t_start,
                          (lambda: torch.cuda.synchronize(w.device)) if w.device.type == "cuda" else None)
        clock.stop()
        try:
            # The step's statistics, summed over the whole world: every rank agrees on the stop,
            # whatever its stage.
            owe = w.book.owes_now()
            copying = w.copies.holding_back(w.step, w._progress.get("step_s"))
            check_grads = tr.clip_grad_norm is not None or scale is not None
            # Where every rank ends with the whole gradient (ddp), its norm needs no collective, and
            # the rest rides on the gradients' own reduction. Otherwise the squared norm of this
            # rank's part joins the statistics in one all-reduce after the reduction.
            flags = StepStats.flags(local_loss, stop, busy, owe, copying)
            ride = w.strategy.whole_grads_everywhere or not check_grads
            carried = w.strategy.reduce_gradients(w.model, flags if ride else None) is not None
            # Only what reads them takes the local views (one per parameter: 54 DTensor to_local calls
            # a step in the fsdp x tp benchmark, counted by benchmarks/probes/tp_op_counts.py).
            grads = w.strategy.local_grads(w.model) if check_grads else []
            if scale is not None:
                torch._foreach_mul_(grads, 1.0 / scale)
            sumsq = (_sum_of_squares(grads, w.device, w.strategy.grad_weights(w.model)) if check_grads
                     else torch.zeros((), device=w.device))
            stats = StepStats.tensor(flags, sumsq)
            if not carried:
                dist.all_reduce(stats)
            norm_sq = sumsq if carried else stats[StepStats.GRAD_SUMSQ] / w.strategy.grad_copies
        except (RuntimeError, dist.DistError) as e:
            raise CollectiveError(f"{type(e).__name__}: {e}") from e
        grad_norm = norm_sq.sqrt()
        # Every decision below reads one host copy: on a GPU each read of a device tensor is a
        # synchronisation of its own (on a CPU, `.cpu()` is the same tensor).
        agreed = StepStats.read(stats.cpu())
        compute_s = clock.seconds()  # on a GPU, read now that the host copy has synchronised the stream
        self._update(tr, grads, agreed, grad_norm)
        w.set_progress(grad_norm=float(grad_norm) if tr.clip_grad_norm is not None or w.amp else None)
        w.step += 1
        if w.scheduler is not None:
            w.scheduler.step()  # once per step, skipped or not: the schedule is a function of the step
        loss = agreed.loss_sum / w.strategy.loss_ranks
        step = w.step
        ledger = (LedgerEntry(step, lay.data_world, replica, tuple(idx), w.order.num_samples)
                  if w.job.run.sample_ledger and lay.stage_of(w.rank) == lay.tp_of(w.rank) == 0 else None)  # one rank per share

        def report() -> None:
            """The step, done: what the next poll tells the controller (its time counts the wait
            for the copies where they held the report)."""
            now, step_s = time.time(), time.perf_counter() - t_start
            with self._lock:
                self.compute_log.append(StepRecord(step, compute_s, loss, now, step_s))
                if ledger is not None:
                    self.ledger.append(ledger)
            w.set_progress(step=step, loss=loss, step_end=now, step_s=step_s, compute_s=compute_s,
                           first_step_end=w._progress.get("first_step_end") or now)

        if w.copies.holds_report(step):  # memory_sync: reported once every rank's copy of it is in
            self.held_report = report
        else:
            report()
        return agreed

    def report_held(self) -> None:
        """Report the step whose report waited for its in-memory copies (memory_sync)."""
        report, self.held_report = self.held_report, None
        if report is not None:
            report()

    def _update(self, tr, grads: list[torch.Tensor], stats: StepStats, grad_norm: torch.Tensor) -> None:
        """The optimizer step of step `worker.step + 1`, decided the same way on every rank from the
        all-reduced stats: skipped after a rollback, after an fp16 overflow (the loss scale backs
        off), or for a non-finite loss or gradient (train.bad_step); clipped to the global norm."""
        w = self.w
        step = w.step + 1
        bad_loss, bad_grads = stats.bad_loss, stats.bad_grads
        if step in self.skip_steps:
            self._skip(step, "rolled back: this batch is skipped")
            return
        if w.amp and bad_grads and not bad_loss:
            w.amp["scale"].mul_(0.5)
            w.amp["good_steps"].zero_()
            self._skip(step, "fp16 overflow: loss scale halved")
            return
        if bad_loss or bad_grads:
            what = "loss" if bad_loss else "gradient norm"
            if tr.bad_step == "raise":
                raise BadStep(step, f"step {step}: non-finite {what} on some rank (train.bad_step=raise)")
            self._bad_in_a_row.append(step)
            self._skip(step, f"non-finite {what} (train.bad_step={tr.bad_step})")
            if len(self._bad_in_a_row) >= tr.bad_step_limit:
                if tr.bad_step == "skip":
                    raise BadStep(step, f"steps {self._bad_in_a_row}: {len(self._bad_in_a_row)} bad steps in a row "
                                  f"(train.bad_step_limit={tr.bad_step_limit}); last: non-finite {what}")
                raise RollBack(list(self._bad_in_a_row))
            return
        self._bad_in_a_row = []
        if tr.clip_grad_norm is not None:
            coef = tr.clip_grad_norm / (grad_norm + 1e-6)
            if coef < 1 and grads:
                torch._foreach_mul_(grads, coef.to(grads[0].device))  # host gradients under train.fsdp.offload
        w.optimizer.step()
        if w.amp:
            w.amp["good_steps"].add_(1)
            if int(w.amp["good_steps"]) >= LOSS_SCALE_GROWTH_INTERVAL:
                w.amp["scale"].mul_(2.0)
                w.amp["good_steps"].zero_()

    def _skip(self, step: int, why: str) -> None:
        with self._lock:
            self.skipped.append((step, why))

    def calibrate(self, reps: int = 5) -> float | None:
        """Best compute time of one rank's share of a step (forward + backward) on this process,
        after one untimed warm-up: how fast a spare can be, measured before it is trusted with a
        rank. The best of several, not the median: other processes on the machine (a group
        restoring, training beside it) only ever add time, and a spare that is slow itself is
        slow in every repetition. None for a pipeline (a stage's compute needs its peers). With
        tensor parallelism the spare runs the whole model, where a rank computes its slices: its
        time / tp, a lower bound of a rank's (the layers tp does not split count once), so a spare
        is weighed leniently."""
        w = self.w
        tr = w.job.train
        if tr.strategy == "pipeline":
            return None
        replicas = w.job.scaling.num_workers // tr.tp.size
        per_rank = tr.global_batch_size // replicas
        micro, _ = batch_plan(tr.global_batch_size, replicas, tr.micro_batch_size)
        idx = list(range(min(per_rank, len(w.dataset))))
        times = []
        for _ in range(reps + 1):
            clock = ComputeClock(w.device, self._cpu_time)  # the work, timed as the ranks' is
            clock.start()
            for i in range(0, len(idx), micro):
                batch = to_device(default_collate([w.dataset[j] for j in idx[i:i + micro]]), w.device)
                w.fns["loss"](w.model, batch).backward()
            clock.stop()
            times.append(clock.seconds() * w.slow_factor)
        w.model.zero_grad(set_to_none=True)
        return min(times[1:]) / tr.tp.size  # the first allocates gradients and warms caches: not timed

    def forget_bad_run(self) -> None:
        """After a restore every rank of the new group counts consecutive bad steps from zero:
        survivors and a replacement (which never saw the old count) then agree on when the limit
        is reached, so they roll back, or stop, together."""
        self._bad_in_a_row = []


_AUTOCAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _scaled(loss_fn, scale: torch.Tensor):
    return lambda *args: loss_fn(*args) * scale


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device, weights: list[float] | None = None) -> torch.Tensor:
    """Sum of squares of `grads`, each weighted (tensor parallelism: 1 / its copies in the tp group)."""
    if not grads:
        return torch.zeros((), device=device)
    sq = torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2)
    if weights is not None:
        sq = sq * torch.tensor(weights, dtype=sq.dtype, device=sq.device)
    return sq.sum().to(device)
