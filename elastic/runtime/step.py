"""One training step of one rank: its batches (elastic/runtime/batches.py), forward and backward
through the strategy, the step's statistics summed over the whole world in one collective
(`StepStats`, elastic/runtime/step_stats.py), and the update every rank decides the same way from
them (clipping, fp16 loss scaling, bad steps).

A steady step makes the host wait for the device nowhere, where the optimizer allows it. With
an optimizer that takes `found_inf` (torch's fused Adam, AdamW and SGD) the update's decision is
taken on the device: a bad step's update is masked, fp16's loss scale moves, clipping scales by
min(1, coefficient). The host reads the step's statistics one step late, from a copy that did not
wait (the next step's work is queued by then), and acts on them there: a bad step's record and
verdict, the report of the step (loss, compute time, ledger), the agreed flags. Where the run
loop must act on a step's own flags (a checkpoint or copy due, a stop seen, the last step) it
reads them at once (`settle`). Any other optimizer gets the update decided on the host: one read
of the statistics before the update, as before.

The worker's run loop calls `StepRunner.train_step` once per step and acts on the flags it
returns (a stop, a checkpoint to skip or to save again); the runner keeps what the step reports
(compute times, the sample ledger, skipped steps) until the next poll.
"""
from __future__ import annotations

import random
import threading
import time
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from elastic.checkpoint.retry import PEER_LOST
from elastic.config import batch_plan
from elastic.parallel.buffers import StepBuffers
from elastic.protocol import LedgerEntry
from elastic.runtime import chaos
from elastic.runtime.batches import RankBatches, to_device
from elastic.runtime.collectives import GroupAborted
from elastic.runtime.compute_clock import ComputeClock, cpu_time_counts
from elastic.runtime.step_report import BadStep, RollBack, StepReports, Unsettled
from elastic.runtime.step_stats import LOSS_SCALE_INIT, StepStats, StepTensors, update_loss_scale
from elastic.runtime.user_metrics import UserMetrics, loss_of, refuse_metrics

# What state.py and worker.py import from here.
__all__ = ["LOSS_SCALE_INIT", "BadStep", "CollectiveError", "RollBack", "StepRunner", "StepStats"]

if TYPE_CHECKING:
    from elastic.runtime.worker import Worker


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG seed for one rank's step. RNG state is a function of (seed, step, rank), so a
    restored run draws exactly what the uninterrupted run drew, with nothing extra to save."""
    return (seed * 1_000_003 + step * 7919 + rank) % (2**63)


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, hung past the backstop, or the group was torn down."""


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


class StepRunner(StepReports):
    """Trains one step at a time on the worker's model, optimizer and strategy (`worker`); what
    the steps report and the verdict on each: `StepReports` (elastic/runtime/step_report.py)."""

    def __init__(self, worker: Worker, lock: threading.Lock):
        self.w = worker
        self._lock = lock  # the worker's: poll() drains what the step reports
        self._init_reports()
        self._buffers = StepBuffers()
        self.data = RankBatches(worker)  # what the rank reads each step, read ahead
        self._cpu_time = cpu_time_counts(worker.job)  # how the compute is timed (see compute_clock)
        self._slow = chaos.SlowCompute()  # the "slow" fault, if this process is given one
        self.tensors = StepTensors()
        self.user = UserMetrics()  # what the loss function returns beside the loss, if anything
        # (the optimizer, weakly; whether it takes found_inf on the device)
        self._found_inf_of: tuple = (lambda: None, False)

    # ---------------------------------------------------------------- the step
    def train_step(self, micro: int) -> StepStats:
        """Step `worker.step + 1`. Returns the newest statistics the host has read: this step's
        where the host decides the update, else the step before's (this one's: `settle`). One
        that a lost peer cuts short leaves the model's buffers as they were before it
        (elastic/parallel/buffers.py, StepBuffers): it is redone. A step that fails settles the
        one before it first, which was done."""
        self._buffers.save(self.w.model)
        try:
            return self._train_step(micro)
        except (BadStep, RollBack):
            raise
        except BaseException as e:
            if isinstance(e, CollectiveError):
                self._buffers.restore()
            if self._unsettled is not None:
                # A verdict that ends the run (train.bad_step) on the step before wins over this
                # failure; a rollback does not: the step is kept as skipped, and the recovery
                # resumes the survivors there with their bad run forgotten, which trains the
                # same steps the same way as the rollback would.
                try:
                    self.settle(may_roll_back=False)
                except BadStep:
                    raise
                except Exception:  # noqa: BLE001 - this step's own failure is the one to report
                    pass
            raise

    def _found_inf_taken(self) -> bool:
        """Whether the update can be decided on the device: the optimizer takes `found_inf` as
        GradScaler hands it (torch's fused Adam, AdamW, SGD) and steps on the device the statistics
        are on (not CPU offload, whose optimizer would read the flag before its copy lands)."""
        opt = self.w.optimizer
        if self._found_inf_of[0]() is not opt:  # weakly: a model a restore replaces must be freed
            takes = bool(getattr(opt, "_step_supports_amp_scaling", False)) and all(
                p.device == self.w.device for g in opt.param_groups for p in g["params"])
            self._found_inf_of = (weakref.ref(opt), takes)
        return self._found_inf_of[1]

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
        if tr.strategy == "pipeline":
            loss_fn = refuse_metrics(w.fns["stage_loss"], "train.pipeline.loss", _PIPELINE_METRICS)
        else:  # innermost: the wrappers below take the loss alone
            loss_fn = self.user.wrap(w.fns["loss"])
        scale = w.amp["scale"] if w.amp else None
        if scale is not None:  # fp16: scale the loss so small gradients survive; unscaled below
            loss_fn = _scaled(loss_fn, scale)
        loss_fn = self._slow.wrap(loss_fn, w.slow_factor,
                                  inside=tr.strategy != "pipeline" and w.device.type != "cuda")
        try:
            with torch.autocast(w.device.type, dtype=_AUTOCAST[tr.precision], enabled=tr.precision != "fp32"):
                local_loss = w.strategy.train_step(w.model, idx, self.data.load, loss_fn, micro)
            # Without waiting: a pipeline's middle stage returns a host zero.
            local_loss = local_loss.float().to(w.device, non_blocking=True)
        except Exception as e:
            if is_collective_failure(e):
                raise CollectiveError(f"{type(e).__name__}: {e}") from e
            raise
        finally:
            self.data.step_done()
        if scale is not None:
            local_loss = local_loss / scale
        user = (self.user.vector([min(micro, len(idx) - i) for i in range(0, len(idx), micro)],
                                 w.device) if tr.strategy != "pipeline" else None)
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
            flags = self.tensors.flags(local_loss, stop, busy, owe, copying)
            if user is not None:  # the user's metrics ride with the flags: no collective of its own
                flags = self.tensors.with_user(flags, user)
            ride = w.strategy.whole_grads_everywhere or not check_grads
            carried = w.strategy.reduce_gradients(w.model, flags if ride else None) is not None
            # Only what reads them takes the local views (one per parameter: 54 DTensor to_local calls
            # a step in the fsdp x tp benchmark, counted by benchmarks/probes/tp_op_counts.py).
            grads = w.strategy.local_grads(w.model) if check_grads else []
            if scale is not None:
                torch._foreach_mul_(grads, 1.0 / scale)
            sumsq = (self.tensors.sum_of_squares(grads, w.device, w.strategy.grad_weights(w.model))
                     if check_grads else None)
            stats = StepTensors.with_sumsq(flags, sumsq) if check_grads else flags
            if not carried:
                dist.all_reduce(stats)
        except (RuntimeError, dist.DistError) as e:
            raise CollectiveError(f"{type(e).__name__}: {e}") from e
        copies = 1 if carried else w.strategy.grad_copies
        grad_norm = None
        if check_grads:
            grad_norm = (sumsq if carried else stats[StepStats.GRAD_SUMSQ] / copies).sqrt()
        step = w.step + 1
        skipped = step in self.skip_steps
        ledger = (LedgerEntry(step, lay.data_world, replica, tuple(idx), w.order.num_samples)
                  if w.job.run.sample_ledger and lay.stage_of(w.rank) == lay.tp_of(w.rank) == 0 else None)  # one rank per share
        deferred = self._found_inf_taken()
        if deferred:
            # The step before's statistics, read now that this step's work is queued behind their
            # copy; a verdict on it (a rollback, train.bad_step=raise) comes before this update.
            try:
                agreed = self.settle()
            except (BadStep, RollBack):
                self._buffers.restore()  # this step never happened
                raise
            found = self.tensors.found(stats)
            host, event = self.tensors.to_host(stats)
            if not skipped:
                self._apply(tr, grads, grad_norm, found)
        else:
            # The one read of a step whose optimizer takes no found_inf: on a GPU the host waits
            # here for backward and the reduction, then decides the update.
            host, event = stats.cpu(), None
            agreed = StepStats.read(host)
            if self._judge(step, agreed, skipped):
                self._apply(tr, grads, grad_norm, None)
        if w.amp and not skipped:
            update_loss_scale(w.amp, stats)
        w.step += 1
        if w.scheduler is not None:
            w.scheduler.step()  # once per step, skipped or not: the schedule is a function of the step
        ended = (time.time(), time.perf_counter() - t_start)
        rec = Unsettled(step, host, event, clock, t_start, ended, skipped, copies, ledger)
        if deferred:
            self._unsettled = rec
        else:
            self._report(rec, agreed)  # read and judged above
        return agreed

    def _apply(self, tr, grads: list[torch.Tensor], grad_norm: torch.Tensor | None,
               found: torch.Tensor | None) -> None:
        """The optimizer step, clipped to the global norm (by min(1, coefficient): a factor of 1
        leaves every bit as it is, and no read decides it), masked where `found` is 1."""
        w = self.w
        if tr.clip_grad_norm is not None and grads:
            coef = (tr.clip_grad_norm / (grad_norm + 1e-6)).clamp(max=1.0)
            # .to(): host gradients under train.fsdp.offload
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        if found is None:
            w.optimizer.step()
            return
        w.optimizer.found_inf = found  # as torch's GradScaler hands it to a fused optimizer
        try:
            w.optimizer.step()
        finally:
            del w.optimizer.found_inf

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
                loss_of(w.fns["loss"](w.model, batch)).backward()  # metrics beside it: unread
            clock.stop()
            times.append(clock.seconds() * w.slow_factor)
        w.model.zero_grad(set_to_none=True)
        return min(times[1:]) / tr.tp.size  # the first allocates gradients and warms caches: not timed


# Why a pipeline's stage loss returns the loss alone (docs/getting-started.md, "Your own metrics").
_PIPELINE_METRICS = ("metrics beside the loss are taken from train.loss under ddp and fsdp (and "
                     "with tensor parallelism), not from a pipeline's stage loss")

_AUTOCAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _scaled(loss_fn, scale: torch.Tensor):
    return lambda *args: loss_fn(*args) * scale
