"""Variants of the workloads that resize tests need: a model without kinks, and losses that pace
a shrunken run."""
from __future__ import annotations

import time

import torch.distributed as dist
from torch import nn

from elastic.workload import IN_FEATURES, NUM_CLASSES, build_mlp, hidden_width
from elastic.workload import loss_fn as _loss_fn


def build_smooth_model() -> nn.Module:
    """The workload's MLP with GELU for ReLU. Runs at different world sizes sum gradients in
    another order, so they differ by float rounding; with ReLU, a hidden unit that sits at its
    kink in some step can take the other branch in one run, and that unit's row then differs by
    orders of magnitude more than rounding (up to 1.05e-3 in a momentum buffer after 300 steps,
    seen once in CI). GELU has no kink: such runs stay at rounding level, so a tolerance can
    catch real re-shard bugs without being loosened for chance events."""
    return build_mlp(hidden_width(), activation=nn.GELU)


def build_bn_model() -> nn.Module:
    """The workload's MLP (its hidden width) with a BatchNorm1d after the first layer: buffers
    (running mean and variance) that each replica's forward updates from its own samples, so
    replicas drift apart unless the strategy keeps them equal (elastic/parallel/buffers.py)."""
    hidden = hidden_width()
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, NUM_CLASSES),
    )


SHRUNK_EXTRA_S = 0.3


def loss_slower_while_shrunk(model, batch):
    """The workload's loss, SHRUNK_EXTRA_S slower per call while the group has fewer than 3 ranks.

    Resize tests shrink 3 -> 2 and then give capacity back. At full speed the shrunken run can
    reach its last step before the new node has started and its worker warmed (CI saw it on a
    loaded machine: the run ended with no grow to test). Slower steps at 2 ranks widen that
    window to SHRUNK_EXTRA_S x the remaining steps; the arithmetic is the workload's, and a run
    that never shrinks is not slowed at all."""
    _pace_while_shrunk(SHRUNK_EXTRA_S)
    return _loss_fn(model, batch)


SHRUNK_STAGE_EXTRA_S = 0.1


def stage_loss_slower_while_shrunk(logits, target):
    """The GPT example's pipeline loss (examples.gpt:stage_loss), SHRUNK_STAGE_EXTRA_S slower per
    micro-batch while the group has fewer than 3 ranks: the pipeline version of
    loss_slower_while_shrunk. A 3-stage run re-partitioned onto 2 stages took 0.035 s a step here,
    so its last 135 steps took under 5 s, and CI saw the run end before the returned capacity's
    worker had warmed (no grow to test). Only the time changes, never the arithmetic."""
    from examples.gpt import stage_loss
    _pace_while_shrunk(SHRUNK_STAGE_EXTRA_S)
    return stage_loss(logits, target)


def gpt_loss_slower_below_4_ranks(model, batch):
    """examples.gpt:loss_fn, 0.3 s slower per step while a dp x tp = 2 x 2 group has shrunk to one
    replica, so the run cannot end before the returned replica has warmed (a 3-D shrink drill
    once ended at 4 of its 8 ranks with nothing grown back). Only the time changes, never the
    arithmetic."""
    from examples.gpt import loss_fn
    _pace_while_shrunk(0.3, below=4)
    return loss_fn(model, batch)


def _pace_while_shrunk(extra_s: float, below: int = 3) -> None:
    if dist.is_initialized() and dist.get_world_size() < below:
        time.sleep(extra_s)


INIT_LOG_ENV = "ELASTIC_TEST_INIT_LOG"


def counting_init(name: str, module: nn.Module) -> None:
    """train.init that initialises as reset_parameters() does and appends the module's name to
    the file $ELASTIC_TEST_INIT_LOG.<pid>: which builds initialised what, per process."""
    import os
    module.reset_parameters()
    with open(f"{os.environ[INIT_LOG_ENV]}.{os.getpid()}", "a") as f:
        f.write(name + "\n")
