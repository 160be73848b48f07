"""What a rank's memory looks like now, for the per-rank memory series (`MemorySample`, reported
with each poll): "out of memory after hours of stable training" is the classic long-run failure,
and a slow climb shows it coming.

Host: the worker process's resident set, and the most it may have (the node's memory, or its
cgroup's limit where that is lower: what the OOM killer goes by, in a Kubernetes pod too). GPU
(CUDA only): what the caching allocator holds for tensors (allocated) and from the driver
(reserved), the peak allocated since the process started, the device's total, and fragmentation:
the share of reserved memory that is free but cut into pieces (`inactive_split_bytes` over
reserved), which a large allocation cannot use.

Sampled at most once a second (a poll comes every 0.2 s); cheap: one read of /proc, one
`torch.cuda.memory_stats()`."""
from __future__ import annotations

import os
import time

import psutil

from elastic.protocol import MemorySample

SAMPLE_EVERY_S = 1.0
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_limit_bytes() -> int:
    """The node's memory, or the cgroup's limit where one is set and lower."""
    total = psutil.virtual_memory().total
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(total, int(text))
    return total


class MemoryWatch:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._proc = psutil.Process(os.getpid())
        self._limit = host_limit_bytes()
        self._last: MemorySample | None = None
        self._at = float("-inf")

    def sample(self) -> MemorySample:
        now = self._clock()
        if self._last is None or now - self._at >= SAMPLE_EVERY_S:
            self._last, self._at = self._measure(), now
        return self._last

    def _measure(self) -> MemorySample:
        rss = self._proc.memory_info().rss
        gpu = {}
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stats = torch.cuda.memory_stats()
            reserved = stats.get("reserved_bytes.all.current", 0)
            gpu = {"gpu_allocated_bytes": stats.get("allocated_bytes.all.current", 0),
                   "gpu_reserved_bytes": reserved,
                   "gpu_peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
                   "gpu_total_bytes": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
                   "gpu_fragmentation": stats.get("inactive_split_bytes.all.current", 0) / reserved if reserved else 0.0}
        return MemorySample(rss_bytes=rss, host_limit_bytes=self._limit, **gpu)
