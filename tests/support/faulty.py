"""Training callables that misbehave on purpose, for tests of the error paths."""
from __future__ import annotations

import os

import torch

from elastic.workload import loss_fn as _loss_fn

_calls = 0


def loss_fails_on_fifth_call(model, batch):
    """A user bug that shows up after a few steps: a retry would hit it again."""
    global _calls
    _calls += 1
    if _calls == 5:
        raise ZeroDivisionError("bug in the user's loss on its 5th call")
    return _loss_fn(model, batch)


# Samples whose loss is NaN: the steps that draw them go bad (train.bad_step drills). Chosen by
# sample id, so the bad steps follow the run's data order whatever the world size.
POISONED = {int(i) for i in os.environ.get("ELASTIC_POISONED_SAMPLES", "").split(",") if i}


class PoisonedDataset(torch.utils.data.Dataset):
    """The bench workload's data, each sample tagged with its id (the loss poisons tagged ones)."""

    def __init__(self):
        from elastic.workload import TeacherDataset
        self.base = TeacherDataset()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x, y, i


def poisoned_dataset() -> PoisonedDataset:
    return PoisonedDataset()


def poisoned_loss(model, batch):
    """The workload's loss, NaN when the micro-batch holds a poisoned sample."""
    x, y, ids = batch
    loss = _loss_fn(model, (x, y))
    if POISONED & {int(i) for i in ids}:
        return loss * float("nan")
    return loss


def warmup_cosine(optimizer):
    """Linear warmup over 5 steps, then cosine decay over 45: a schedule as real jobs use."""
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=45)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cos], milestones=[5])


def rollback_drill_loss(model, batch):
    """NaN on the first sample of steps 13 and 14 of the seed-7, batch-48 order (the chaos tests'
    job): two bad steps in a row, for train.bad_step=rollback on a real cluster."""
    from elastic.workload import NUM_SAMPLES
    from elastic.data.order import GlobalOrder
    global _drill_ids
    if _drill_ids is None:
        order = GlobalOrder(NUM_SAMPLES, 7)
        _drill_ids = {order.indices(s * 48, s * 48 + 1)[0] for s in (12, 13)}
    x, y, ids = batch
    loss = _loss_fn(model, (x, y))
    return loss * float("nan") if _drill_ids & {int(i) for i in ids} else loss


_drill_ids = None
