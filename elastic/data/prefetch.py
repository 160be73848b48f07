"""Batches read ahead by DataLoader worker processes, in the run's global sample order.

`train.data_workers: N` gives each rank N processes (torch's DataLoader workers)
that read and collate the rank's upcoming batches while it trains: the samples
and their order are exactly those the rank would read itself, only earlier.

The order is a plan, not a stream: `keys(step)` says which batches (micro-batch
sample ids) the rank trains on in `step`, and the plan changes when the world
does (a restore to an earlier step, a resize that moves the rank's slice). So
each batch comes back tagged with its (step, ids) key, and a request for a key
the loader is not about to deliver restarts it at that step: a plan change
costs the batches read ahead, never a wrong or a missed sample. The worker
processes are kept across restarts (persistent workers); only indices travel.
"""
from __future__ import annotations

import logging
import multiprocessing
import random
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

logger = logging.getLogger(__name__)

Key = tuple[int, tuple[int, ...]]  # (step, the batch's sample ids in order)


def collate(dataset, ids: list[int]):
    """The collated batch of `ids`: in one call where the dataset reads a batch at once
    (`__getitems__`, as torch's DataLoader uses it), else sample by sample."""
    many = getattr(dataset, "__getitems__", None)
    return default_collate(many(ids) if many is not None else [dataset[j] for j in ids])


def seed_batch(seed: int, key: Key) -> None:
    """Seed Python's `random`, NumPy and torch in a data worker for one batch, from the run seed,
    the step and the batch's first sample: a dataset's random augmentation then draws the same
    numbers whichever worker reads the batch, and after any restore or restart."""
    step, ids = key
    s = (seed * 1_000_003 + step * 7919 + (ids[0] if ids else 0) * 104_729 + 17) % (2**63)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


class _Tagged(torch.utils.data.Dataset):
    """The user's dataset, read a batch at a time by key: returns (key, collated batch). Each
    batch is read with the random generators seeded for it (`seed_batch`)."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]

    def __getitems__(self, key: Key):
        seed_batch(self.seed, key)  # in the worker process: the training step's generators do not move
        return key, collate(self.dataset, list(key[1]))


def check_data_workers(tr, dataset) -> None:
    """Data workers started by forkserver or spawn receive the dataset pickled: ValueError naming
    the settings now, rather than an error inside torch's DataLoader at the first step."""
    if not tr.data_workers or tr.data_workers_start == "fork":
        return
    import pickle
    try:
        pickle.dumps(dataset)
    except Exception as e:  # noqa: BLE001 - any pickling failure: the message names it
        raise ValueError(f"train.data_workers={tr.data_workers} with train.data_workers_start={tr.data_workers_start} "
                         f"sends the dataset of {tr.dataset_ref} to each data worker pickled, and it does not pickle "
                         f"({type(e).__name__}: {e}); make it picklable, or set train.data_workers_start: fork") from e


def _as_is(x):
    return x


class _Plan:
    """The batch sampler: every key of the plan from a start step on, for ever (the run's end
    is the trainer's business; the loader never reads further than `depth` batches ahead)."""

    def __init__(self):
        self.keys: Callable[[int], list[Key]] | None = None
        self.start = 0

    def __iter__(self) -> Iterator[Key]:
        step = self.start
        while True:
            yield from self.keys(step)
            step += 1


class Prefetcher:
    """Reads a rank's batches ahead in `workers` processes, at most `depth` batches per worker.

    `get(step, ids, keys)` returns the collated batch for those ids, read ahead when the plan
    had them coming. `keys(step)` lists the (step, ids) keys of one step in the order the
    rank asks for them; it is called on this process's thread as the loader dispatches.
    """

    def __init__(self, dataset, workers: int, depth: int, start_method: str, pin_memory: bool = False,
                 seed: int = 0):
        self._plan = _Plan()
        self._loader = DataLoader(
            _Tagged(dataset, seed), batch_sampler=self._plan, collate_fn=_as_is, num_workers=workers,
            prefetch_factor=depth, persistent_workers=True, pin_memory=pin_memory,
            multiprocessing_context=multiprocessing.get_context(start_method),
            # The loader draws its workers' base seed from this generator at each restart, not from
            # torch's global one: the training step's random stream must not move.
            generator=torch.Generator().manual_seed(0))
        self._window = workers * depth  # batches in flight at most
        self._it = None
        self._next: Key | None = None  # what the iterator delivers next, if known
        self._held = None  # a batch taken from the iterator by start(), not yet asked for
        self.restarts = 0

    def get(self, step: int, ids: list[int], keys: Callable[[int], list[Key]]):
        """The collated batch of `ids` for `step`, or None when the plan does not have it (the
        caller reads it itself)."""
        want: Key = (step, tuple(ids))
        plan = keys(step)
        if want not in plan:
            return None
        for restart in (False, True):
            if restart or self._it is None or self._next != want:
                self._restart(step, keys)
            # After a restart `want` is at most len(plan) batches away; otherwise it is next, unless
            # the loader dispatched some batches under an older plan (the world changed meanwhile).
            for _ in range(len(plan) + self._window):
                key, batch = self._take()
                if key == want:
                    self._next = self._following(key, keys)
                    return batch
                if key[0] > step:
                    break
        raise RuntimeError(f"data prefetch: step {step}'s batch of {len(ids)} samples never came")

    def start(self, step: int, keys: Callable[[int], list[Key]]) -> None:
        """Be ready for `step`: (re)start reading there unless already about to, and wait for its
        first batch. Called while a rank restores, so that starting the processes (seconds with
        forkserver: each imports torch) is part of the restore, not of the first step."""
        first = keys(step)[0]
        if self._it is None or self._next != first:
            self._restart(step, keys)
        if self._held is None:
            self._held = next(self._it)

    def _take(self):
        held, self._held = self._held, None
        return held if held is not None else next(self._it)

    def _following(self, key: Key, keys: Callable[[int], list[Key]]) -> Key:
        step_keys = keys(key[0])
        i = step_keys.index(key)
        return step_keys[i + 1] if i + 1 < len(step_keys) else keys(key[0] + 1)[0]

    def _restart(self, step: int, keys: Callable[[int], list[Key]]) -> None:
        self._plan.keys, self._plan.start = keys, step
        if self._it is not None:
            self.restarts += 1
            logger.debug("data prefetch restarts at step %d (restart %d)", step, self.restarts)
        self._held = None
        self._it = iter(self._loader)  # persistent workers: a reset, not new processes
        self._next = keys(step)[0]

    def close(self) -> None:
        it, self._it, self._held = self._it, None, None
        if it is not None:
            it._shutdown_workers()
