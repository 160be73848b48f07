"""Data workers (train.data_workers): real DataLoader worker processes read a rank's batches ahead
in the global order, and a change of plan (a restore to an earlier step, a resize that moves the
rank's slice) costs only the batches read ahead, never a wrong or a missed one."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

from elastic.data.order import GlobalOrder
from elastic.data.prefetch import Prefetcher

pytestmark = pytest.mark.timeout(120)

N, BATCH = 64, 12
DATA = TensorDataset(torch.arange(N * 3, dtype=torch.float32).reshape(N, 3), torch.arange(N))
ORDER = GlobalOrder(N, seed=5)


def plan(world: int, rank: int, micro: int):
    def keys(step):
        ids = ORDER.rank_indices(step, BATCH, world, rank)
        return [(step, tuple(ids[i:i + micro])) for i in range(0, len(ids), micro)]
    return keys


def direct(ids):
    return default_collate([DATA[i] for i in ids])


def read_step(pf, step, keys):
    got = []
    for _, ids in keys(step):
        batch = pf.get(step, list(ids), keys)
        want = direct(ids)
        assert all(torch.equal(a, b) for a, b in zip(batch, want)), (step, ids)
        got.append(ids)
    return got


@pytest.fixture(scope="module")
def pf():
    p = Prefetcher(DATA, workers=2, depth=2, start_method="forkserver")
    yield p
    p.close()


def test_steps_in_order_come_from_the_workers_without_restarts(pf):
    keys = plan(2, 1, micro=3)  # two micro-batches a step
    pf.start(0, keys)  # as a restore does: the processes up and step 0's first batch read
    assert pf._held is not None and pf._held[0] == keys(0)[0]
    for step in range(6):
        read_step(pf, step, keys)
    assert pf.restarts == 0
    pids = {w.pid for w in pf._it._workers}
    assert len(pids) == 2


def test_a_restore_to_an_earlier_step_and_a_resize_read_the_right_batches(pf):
    keys = plan(2, 1, micro=3)
    read_step(pf, 3, keys)
    before, pids = pf.restarts, {w.pid for w in pf._it._workers}
    read_step(pf, 1, keys)  # back to an earlier step (a restore from a checkpoint)
    read_step(pf, 2, keys)
    assert pf.restarts == before + 1
    # A resize from 2 to 3 ranks: the same step, another slice and size of batch.
    keys3 = plan(3, 2, micro=4)
    read_step(pf, 2, keys3)
    read_step(pf, 3, keys3)
    assert pf.restarts == before + 2
    assert {w.pid for w in pf._it._workers} == pids  # the same processes: only indices travel


def test_every_sample_of_an_epoch_once_through_changes_of_plan(pf):
    """A rank's whole view over steps 0-15 with a resize at step 5 and a restore at step 9 back to
    step 7: the samples read per step are exactly the plan's, so with the other ranks (same
    plan) the epoch's samples are each read once per completed step."""
    seen: dict[int, list[int]] = {}
    for world, steps in ((2, range(0, 5)), (3, range(5, 9)), (3, range(7, 16))):
        for step in steps:
            for rank in range(world):
                if rank == 0:  # this process's loader serves rank 0; the others read directly
                    keys = plan(world, rank, micro=2)
                    seen[step] = [i for ids in read_step(pf, step, keys) for i in ids]
                else:
                    seen[step] = seen.get(step, []) + ORDER.rank_indices(step, BATCH, world, rank)
    flat = [i for s in sorted(seen) for i in seen[s]]
    assert sorted(flat[:N]) == list(range(N))  # steps 0-4 and 5..: the first epoch, each sample once


def test_a_batch_outside_the_plan_is_left_to_the_caller(pf):
    assert pf.get(0, [1, 2, 3], plan(2, 0, micro=3)) is None


def test_data_worker_settings_are_checked():
    from elastic.config import ConfigError, parse_job
    job = {"run": {"name": "x"}, "scaling": {"num_workers": 2},
           "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                     "loss": "elastic.workload:loss_fn", "global_batch_size": 16}}
    with pytest.raises(ConfigError, match="train.data_workers"):
        parse_job({**job, "train": {**job["train"], "data_workers": -1}})
    with pytest.raises(ConfigError, match="train.prefetch.*train.data_workers"):
        parse_job({**job, "train": {**job["train"], "data_workers": 2, "prefetch": True}})
    with pytest.raises(ConfigError, match="data_workers_start"):
        parse_job({**job, "train": {**job["train"], "data_workers": 2, "data_workers_start": "thread"}})


class _Unpicklable(TensorDataset):
    def __reduce__(self):
        raise TypeError("holds an open handle")


def unpicklable_dataset():
    return _Unpicklable(DATA.tensors[0], DATA.tensors[1])


def test_a_dataset_that_does_not_pickle_is_refused_before_any_worker_starts(tmp_path):
    from elastic import Trainer
    from elastic.config import ConfigError
    job = {"run": {"name": "x"}, "scaling": {"num_workers": 2},
           "checkpoint": {"storage_uri": f"file://{tmp_path}"},
           "train": {"model": "elastic.workload:build_model", "dataset": "tests.test_prefetch:unpicklable_dataset",
                     "loss": "elastic.workload:loss_fn", "global_batch_size": 16, "data_workers": 2}}
    with pytest.raises(ConfigError, match="train.data_workers=2 .*does not pickle.*data_workers_start: fork"):
        Trainer(job)
    Trainer({**job, "train": {**job["train"], "data_workers_start": "fork"}})  # fork copies it: accepted


class Augmented(torch.utils.data.Dataset):
    """A sample with random augmentation from all three generators a dataset may use."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        import random

        import numpy as np
        return torch.tensor([float(i), random.random(), float(np.random.rand()), torch.rand(()).item()])


def test_random_augmentation_in_data_workers_repeats_after_a_restore_whatever_the_workers():
    """The workers seed Python's, NumPy's and torch's generators for each batch from the run seed
    and the batch's step: a run restored at step 3 reads the augmented batches of steps 3-5 that
    the uninterrupted run read, with another number of workers too; another seed draws others."""
    keys = plan(1, 0, micro=4)

    def read(workers: int, first: int, seed: int = 11) -> dict:
        p = Prefetcher(Augmented(), workers=workers, depth=2, start_method="forkserver", seed=seed)
        try:
            p.start(first, keys)
            return {(s, ids): p.get(s, list(ids), keys) for s in range(first, 6) for _, ids in keys(s)}
        finally:
            p.close()

    whole, restored = read(2, 0), read(3, 3)
    assert restored and all(torch.equal(whole[k], b) for k, b in restored.items())
    assert all(len(set(b[:, 1].tolist())) == len(b) for b in whole.values())  # random within a batch
    other = read(2, 3, seed=12)
    assert not any(torch.equal(whole[k], b) for k, b in other.items())
