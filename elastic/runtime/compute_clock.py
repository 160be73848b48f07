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

Where the forward and backward hold collectives of their own (FSDP's all-gathers and
reduce-scatters, HSDP's, tensor parallelism's all-reduces), a rank waits inside them for the
slowest rank of its group, so every rank's wall clock shows the straggler's time and none stands
out. On a CPU the clock then reads CPU time instead (`cpu_time`): gloo's waits block, so they
take none (measured: a rank waiting 1 s in an all-reduce used 0.2 ms of its thread's CPU), and
what is left is the rank's own work. The training thread's, when torch computes on it alone (one
intra-op thread); the process's otherwise. A rank slowed by a slower or throttled core is found
this way; one slowed only by another process taking turns on its core keeps its CPU time and is
not. On a GPU such a strategy's interval still holds the collectives' waits (not solved here).
"""
from __future__ import annotations

import time

import torch


def cpu_time_counts(job) -> bool:
    """Whether a job's compute holds collectives that straggler detection must see through (fsdp,
    HSDP, tensor parallelism), so that on a CPU its ranks are timed by CPU time (see above). A
    pipeline's stages wait for each other too, but have no straggler swaps: wall clock."""
    tr = job.train
    return tr.strategy == "fsdp" or tr.tp.size > 1


class ComputeClock:
    def __init__(self, device: torch.device, cpu_time: bool = False):
        self.cuda = device.type == "cuda"
        self._t0 = self._t1 = 0.0
        self._events: tuple | None = None
        self._now = time.perf_counter
        if cpu_time and not self.cuda:
            self._now = time.thread_time if torch.get_num_threads() == 1 else time.process_time

    def start(self) -> None:
        self._t0 = self._now()
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        """The rank's own work of the step is queued (GPU) or done (CPU)."""
        self._t1 = self._now()
        if self.cuda:
            self._events[1].record()

    def seconds(self) -> float:
        """The step's compute time. On a GPU call it once the stream has passed stop() (after the
        step's host copy); called earlier it waits for that point."""
        if self.cuda:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1e3  # ms
        return self._t1 - self._t0
