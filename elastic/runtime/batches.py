"""The batches one rank reads each step: its share of the global sample order (by its dp
coordinate), cut into micro-batches, and read ahead while the step before computes (a thread
collating them, the dataset's own `prefetch`, or data worker processes)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from elastic.config import batch_plan
from elastic.data.prefetch import Prefetcher, collate

if TYPE_CHECKING:
    from elastic.runtime.worker import Worker


class RankBatches:
    """This rank's batches, for `worker`'s job, layout and step."""

    def __init__(self, worker: Worker):
        self.w = worker
        self.micro = 0  # this run's per-rank micro-batch (0: the rank's whole share at once)
        self._pool = None  # train.prefetch: the thread that collates the next step's batches
        self._ahead: dict = {}  # this step's prefetched batches: micro-batch sample ids -> future
        self._upcoming: dict = {}  # the next step's
        self._loader: Prefetcher | None = None  # train.data_workers: processes that read batches ahead

    def micro_batch(self) -> int:
        """This rank's micro-batch at the current world size (0 for a pipeline: it splits each
        replica's share into train.pipeline.microbatches itself)."""
        tr = self.w.job.train
        if tr.strategy == "pipeline":
            return 0
        return batch_plan(tr.global_batch_size, self.w.layout.data_world, tr.micro_batch_size)[0]

    def start(self) -> None:
        """Data workers (train.data_workers) start reading at the restored step during the
        restore: their start is seconds (each imports torch), which the first step must not be
        charged with (the controller would take it for a hang)."""
        w = self.w
        tr = w.job.train
        if not tr.data_workers or not w.strategy.needs_data:
            return
        self.micro = self.micro_batch()
        if self._loader is None:
            self._loader = Prefetcher(w.dataset, tr.data_workers, tr.data_prefetch_factor, tr.data_workers_start,
                                      pin_memory=w.device.type == "cuda", seed=w.job.run.seed)
        self._loader.start(w.step, self.keys)

    def load(self, ids: list[int]):
        """The collated batch of global sample ids, on this rank's device: read ahead if it was
        (by the data workers, or the train.prefetch thread), else read now. A dataset that reads
        a batch at once (`__getitems__`, as torch's DataLoader uses) does."""
        batch = None
        if self._loader is not None:  # train.data_workers (started by the restore)
            batch = self._loader.get(self.w.step, ids, self.keys)
        else:
            ahead = self._ahead.pop(tuple(ids), None)
            batch = ahead.result() if ahead is not None else None
        if batch is None:
            batch = self._collate(ids)
        return to_device(batch, self.w.device)

    def keys(self, step: int) -> list[tuple[int, tuple[int, ...]]]:
        """The (step, sample ids) of each batch this rank reads in `step`, in the order it reads
        them (its share of the global order, cut into micro-batches): the data workers' plan."""
        w = self.w
        lay, tr = w.layout, w.job.train
        ids = w.order.rank_indices(step, tr.global_batch_size, lay.data_world, lay.data_rank(w.rank))
        m = self.micro or len(ids)
        return [(step, tuple(ids[i:i + m])) for i in range(0, len(ids), m)]

    def _collate(self, ids: list[int]):
        return collate(self.w.dataset, ids)

    def prefetch_next(self, micro: int) -> None:
        """Start on the next step's samples while this step computes: same ids, same order, only
        earlier. train.prefetch collates them on a background thread (in this step's micro-batch
        chunks); a dataset that can read ahead itself (`prefetch(ids)`, e.g. ParquetDataset)
        is told which rows come next."""
        w = self.w
        if not w.strategy.needs_data or w.job.train.data_workers:
            return  # data workers read ahead on their own
        lay, tr = w.layout, w.job.train
        nxt = w.order.rank_indices(w.step + 1, tr.global_batch_size, lay.data_world, lay.data_rank(w.rank))
        if tr.prefetch:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="elastic-prefetch")
            self._upcoming = {tuple(c): self._pool.submit(self._collate, c)
                              for c in ([nxt[i:i + micro] for i in range(0, len(nxt), micro)] if micro else [nxt])}
        elif hasattr(w.dataset, "prefetch"):
            w.dataset.prefetch(nxt)

    def step_done(self) -> None:
        """The step is over: the next one's read-ahead becomes current; what was not used is not kept."""
        self._ahead, self._upcoming = self._upcoming, {}


def to_device(batch, device: torch.device):
    """Move a collated batch (tensors, possibly nested in tuples/lists/dicts) to the device."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
