"""A rank's own compute time in a step: what the straggler policy compares across ranks.

On a CPU a forward and backward are done when the calls return, so the wall clock around them
measures the work. On a GPU the calls only queue kernels and return; the wall clock then measures
their launch, which is the same on a fast GPU and on a throttled one, and a slow GPU would never
be found. There the clock reads two CUDA events recorded on the rank's stream, at the start of the
step and where its own work ends (before the gradient reduction waits on the other ranks), and is
read after the step's host copy of its statistics has synchronised that stream anyway: no
synchronisation of its own.

What the interval holds is the same on both: reading and moving the batch, forward, backward,
and the gradient all-reduces launched during backward (asynchronous: their waits come later).
"""
from __future__ import annotations

import time

import torch


class ComputeClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._t0 = self._t1 = 0.0
        self._events: tuple | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        """The rank's own work of the step is queued (GPU) or done (CPU)."""
        self._t1 = time.perf_counter()
        if self.cuda:
            self._events[1].record()

    def seconds(self) -> float:
        """The step's compute time. On a GPU call it once the stream has passed stop() (after the
        step's host copy); called earlier it waits for that point."""
        if self.cuda:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1e3  # ms
        return self._t1 - self._t0
