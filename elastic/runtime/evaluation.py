"""One rank's part of an evaluation (train.eval_dataset): which batches of the evaluation set it
reads, the model run on them in eval mode under no_grad, and the exact reduction that gives every
rank the same numbers at any world size.

The rule. The evaluation set of N samples is cut into batches of train.eval_batch_size
consecutive samples (`batch_bounds`): the same batches at any world size. The batches, not the
samples, are dealt over the ranks, each a contiguous run (`rank_batches`), so each sample is
evaluated exactly once and each batch's sums are the same bits whichever rank computes them.
Every rank writes its batches' sums (float64) into its rows of one table of all batches, zeros
elsewhere, and one all-reduce sums the tables: a row gets one value and zeros, so it arrives
exactly. Every rank then adds the rows up in float64 with `math.fsum` (exactly rounded: no
order matters), and divides by the number of samples (or by the summed counts). Ranks that hold
fewer batches run their last batch again, uncounted, so that every rank makes as many forwards
(FSDP gathers its parameters inside forward: a rank that stopped early would hang the others).

The worker's run loop asks `due` after each step and calls `evaluate`; the results wait for the
next poll (`take`). Each forward is reported as progress (status EVALUATING): the hang bound
times forwards during an evaluation, not the evaluation's length. Which evaluations are done is
the controller's record (it passes the last step it has an evaluation of to run()): one cut
short by a fault is redone after the recovery.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from elastic.config.evaluation import batch_size as eval_batch_size
from elastic.data.prefetch import collate
from elastic.protocol import EvalResult, RankStatus
from elastic.runtime.batches import to_device
from elastic.runtime.faults import fire_fault
from elastic.runtime.step import CollectiveError, is_collective_failure
from elastic.runtime.user_metrics import loss_of

if TYPE_CHECKING:
    from elastic.runtime.worker import Worker

_AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def batch_bounds(num_samples: int, batch_size: int) -> list[tuple[int, int]]:
    """[start, end) of each evaluation batch: consecutive samples, the last one possibly shorter."""
    return [(i, min(i + batch_size, num_samples)) for i in range(0, num_samples, batch_size)]


def rank_batches(num_batches: int, world: int, rank: int) -> range:
    """The batches `rank` of `world` evaluates: a contiguous run; the runs cover each batch once."""
    return range(rank * num_batches // world, (rank + 1) * num_batches // world)


def forwards_per_rank(num_batches: int, world: int) -> int:
    """Forwards every rank makes: the most batches any rank holds (at least one: a rank with none
    still joins the others' collectives, and learns the metrics' names)."""
    return max(1, -(-num_batches // world))


def batch_sums(values: dict, num_samples: int,
               device: torch.device) -> tuple[list[str], torch.Tensor]:
    """One batch's metrics as (sorted names, float64 tensor [metric, (sum, count)]): a value is
    the sum over the batch's samples (its count: the batch's size), or a pair (sum, count)."""
    names = sorted(values)
    rows = []
    for n in names:
        v = values[n]
        s, c = v if isinstance(v, (tuple, list)) else (v, num_samples)
        rows.append(torch.stack([torch.as_tensor(s, device=device).detach().reshape(()).double(),
                                 torch.as_tensor(c, device=device).detach().reshape(()).double()]))
    if not rows:
        return names, torch.zeros(0, 2, dtype=torch.float64, device=device)
    return names, torch.stack(rows)


def combine(table: torch.Tensor, names: list[str]) -> dict[str, float]:
    """The metrics from the whole table [batch, metric, (sum, count)], every batch's row filled:
    exactly rounded sums in float64, whatever order the rows came in."""
    rows = table.cpu().tolist()
    out = {}
    for m, n in enumerate(names):
        count = math.fsum(r[m][1] for r in rows)
        out[n] = math.fsum(r[m][0] for r in rows) / count if count else float("nan")
    return out


def default_metrics(loss_fn: Callable) -> Callable:
    """Without train.eval_metrics: the training loss (a mean over the batch) as a sum."""
    def metrics(model, batch, n: int) -> dict:
        return {"loss": loss_of(loss_fn(model, batch)).double() * n}  # metrics beside it: unread
    return metrics


class Evaluator:
    """The worker's evaluations: when one is due, running it, and its results until polled."""

    def __init__(self, worker: Worker, lock):
        self.w = worker
        self._lock = lock  # the worker's: poll() takes the results
        self.dataset = None  # built at the first evaluation: a rank never asked never reads it
        self.done_through = 0  # the last step evaluated (the controller's record, then this rank's)
        self._results: list[EvalResult] = []

    @property
    def enabled(self) -> bool:
        return self.w.fns.get("eval_dataset") is not None

    def start(self, evaluated_through: int) -> None:
        self.done_through = evaluated_through

    def due(self, step: int, num_steps: int) -> bool:
        every = self.w.job.train.eval_every_steps
        return (self.enabled and 0 < step and step > self.done_through
                and (step == num_steps or (every is not None and step % every == 0)))

    def take(self) -> tuple[EvalResult, ...]:
        """The results since the last poll (the caller holds the worker's lock)."""
        out, self._results = tuple(self._results), []
        return out

    def evaluate(self, faults: list[dict] = ()) -> EvalResult:
        """Evaluate the model as it is after step `worker.step`, on every rank at once.
        `faults`: chaos faults (`during_eval`) fired after this rank's first batch."""
        w = self.w
        t0 = time.perf_counter()
        try:
            result = self._evaluate(faults)
        except Exception as e:
            if is_collective_failure(e):
                raise CollectiveError(f"{type(e).__name__}: {e}") from e
            raise
        result = EvalResult(step=w.step, metrics=result[0], num_samples=result[1],
                            seconds=round(time.perf_counter() - t0, 6))
        self.done_through = w.step
        if w.rank == 0:  # every rank holds the same numbers: one reports them
            with self._lock:
                self._results.append(result)
        return result

    def _evaluate(self, faults) -> tuple[dict[str, float], int]:
        w, tr = self.w, self.w.job.train
        if self.dataset is None:
            self.dataset = w.fns["eval_dataset"]()
        n = len(self.dataset)
        bounds = batch_bounds(n, eval_batch_size(tr))
        if not bounds:
            return {}, 0
        world, rank = w.layout.data_world, w.layout.data_rank(w.rank)
        mine = list(rank_batches(len(bounds), world, rank))
        user_fn = w.fns["eval_metrics"]
        metrics_fn = (lambda m, b, _n: user_fn(m, b)) if user_fn else default_metrics(w.fns["loss"])
        table = names = None
        was_training = w.model.training
        w.model.eval()
        try:
            with torch.no_grad(), torch.autocast(w.device.type, dtype=_AMP.get(tr.precision),
                                                 enabled=tr.precision in _AMP):
                for i in range(forwards_per_rank(len(bounds), world)):
                    w.set_progress(status=RankStatus.EVALUATING, eval_batches=i)  # progress
                    k = mine[min(i, len(mine) - 1)] if mine else 0
                    lo, hi = bounds[k]
                    batch = to_device(collate(self.dataset, list(range(lo, hi))), w.device)
                    values = metrics_fn(w.model, batch, hi - lo)
                    got_names, sums = batch_sums(values, hi - lo, w.device)
                    if table is None:
                        names = got_names
                        table = torch.zeros(len(bounds), len(names), 2, dtype=torch.float64,
                                            device=w.device)
                    if i < len(mine):  # a repeated batch keeps forwards in step: not counted
                        table[k] = sums
                    if i == 0:
                        for f in faults:
                            fire_fault(w, f)
        finally:
            w.model.train(was_training)
            w.set_progress(status=RankStatus.RUNNING, eval_batches=0)
        if world > 1:
            dist.all_reduce(table)
        return combine(table, names), n
