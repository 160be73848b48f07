"""The user's own metrics: a loss function may return `(loss, {name: scalar tensor, ...})`.

This module owns what such a return must be (checked on every call, from the tensors' metadata
only: no value is read), and how one rank's values over its micro-batches become one vector that
rides in the step's statistics (elastic/runtime/step_stats.py): each micro-batch's values weighted
by its share of the rank's samples, as the loss is (elastic/parallel/base.py, train_step), so that
the sum over the world divided by the ranks that computed a loss is the mean over the global
batch, what one rank with the whole batch would compute where each value is a mean over its
micro-batch's samples. The names are fixed by the first step a rank trains: the statistics'
length must be the same on every rank and at every step, or the all-reduce would not match.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

# Keys a step already has under these names (metrics.json, the loggers; "eval": an evaluation's).
RESERVED = ("loss", "world_size", "step", "eval")
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-/]{0,63}")
WHAT_TO_RETURN = ("return the loss tensor alone, or (loss, {name: tensor}) with the same names at "
                  "every step, each a one-element tensor (a mean over the micro-batch's samples, "
                  "not read with .item())")


class LossReturnError(ValueError):
    """The loss function returned something other than a loss or (loss, {name: scalar tensor})."""


def describe(fn) -> str:
    """The loss function as a user finds it: module:qualified name."""
    fn = getattr(fn, "func", fn)  # functools.partial
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}:{name}" if module else name


def check_metrics(out, names: tuple[str, ...] | None, who: str) -> tuple[str, ...]:
    """The names of the metrics in `out` (the dict a loss function returned beside its loss),
    sorted; raises LossReturnError naming `who` if `out` is not a dict of one-element real
    tensors with usable names, or if its names are not `names` (those of the first step)."""
    def fail(why: str):
        raise LossReturnError(f"the loss function {who} {why}: {WHAT_TO_RETURN}")

    if not isinstance(out, dict):
        fail(f"returned ({'loss'}, {type(out).__name__}) where the second item must be a dict")
    for k, v in out.items():
        if not isinstance(k, str) or not NAME.fullmatch(k):
            fail(f"returned the metric name {k!r}: a name is a string of up to 64 letters, digits, "
                 f"'_', '.', '-' or '/', starting with a letter")
        if k in RESERVED:
            fail(f"returned a metric named {k!r}, which the run already writes (names in use: "
                 f"{', '.join(RESERVED)}): rename it")
        if not isinstance(v, torch.Tensor):
            fail(f"returned metric {k!r} as {type(v).__name__}, not a tensor")
        if v.numel() != 1 or v.is_complex():
            fail(f"returned metric {k!r} as a {v.dtype} tensor of shape {tuple(v.shape)}, "
                 f"not one real value")
    got = tuple(sorted(out))
    if names is not None and got != names:
        fail(f"returned the metrics {list(got)} at this step and {list(names)} at the first")
    return got


class UserMetrics:
    """One rank's metrics: the loss function's returns of one step, and the names fixed by its
    first step (kept for the worker's life: a restored survivor's function is the same one)."""

    def __init__(self):
        self.names: tuple[str, ...] | None = None  # None before the first step; () for none
        self._calls: list[dict[str, torch.Tensor]] = []

    def wrap(self, loss_fn: Callable) -> Callable:
        """`loss_fn` as the strategy calls it (returning the loss alone), keeping what it returned
        beside the loss for `vector`. Starts a step: what an earlier one kept is dropped."""
        self._calls = []
        who = describe(loss_fn)

        def loss_only(*args):
            out = loss_fn(*args)
            if not isinstance(out, tuple):
                if self.names:  # the first step returned metrics: so must every step
                    check_metrics({}, self.names, who)
                self.names = self.names or ()
                return out
            if len(out) != 2 or not isinstance(out[0], torch.Tensor):
                raise LossReturnError(f"the loss function {who} returned a tuple of "
                                      f"{len(out)} items: {WHAT_TO_RETURN}")
            loss, metrics = out
            if self.names == () and metrics:
                check_metrics(metrics, (), who)
            self.names = check_metrics(metrics, self.names, who)
            self._calls.append({k: v.detach() for k, v in metrics.items()})
            return loss
        return loss_only

    def vector(self, chunk_sizes: list[int], device: torch.device) -> torch.Tensor | None:
        """This step's metrics in name order, on `device`: the sum over its micro-batches, each
        weighted by its share of the rank's samples (`chunk_sizes`, in call order), as the loss's
        sum is. None where the loss function returned none."""
        calls, self._calls = self._calls, []
        if not self.names:
            return None
        if len(calls) != len(chunk_sizes):
            raise LossReturnError(f"the loss function was called {len(calls)} times for "
                                  f"{len(chunk_sizes)} micro-batches: metrics need one call each")
        total = sum(chunk_sizes)
        rows = [torch.stack([c[n].reshape(()).float() for n in self.names]) for c in calls]
        if len(rows) == 1:  # a weight of 1 would change no bit and cost two operators
            out = rows[0]
        else:
            out = sum(r * (size / total) for r, size in zip(rows, chunk_sizes))
        return out.to(device, non_blocking=True)


def loss_of(out) -> torch.Tensor:
    """The loss of what a loss function returned, with or without metrics beside it (a spare's
    calibration, an evaluation's default metric: where the metrics are not wanted)."""
    return out[0] if isinstance(out, tuple) else out


def refuse_metrics(loss_fn: Callable, field: str, why: str) -> Callable:
    """`loss_fn` where metrics beside the loss are not taken (a pipeline's stage loss, which
    torch's schedule calls itself): a tuple return fails here, naming `field`, not in torch."""
    who = describe(loss_fn)

    def checked(*args):
        out = loss_fn(*args)
        if isinstance(out, tuple):
            raise LossReturnError(f"the loss function {who} ({field}) returned a tuple: {why}; "
                                  f"return the loss tensor alone")
        return out
    return checked
