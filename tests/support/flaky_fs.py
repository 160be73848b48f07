"""A memory:// filesystem whose next `failures` writes fail: a brief storage outage, for unit tests."""
from __future__ import annotations

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


def flaky_memory_fs(protocol: str) -> type[MemoryFileSystem]:
    """Register and return a memory filesystem under `protocol://`. Set `cls.failures = n` to make
    its next n writes raise ConnectionError. Each protocol has its own (shared) store."""

    class FlakyMemoryFS(MemoryFileSystem):
        failures = 0

        def _open(self, path, mode="rb", **kw):
            if "w" in mode and type(self).failures > 0:
                type(self).failures -= 1
                raise ConnectionError("storage unavailable (injected)")
            return super()._open(path, mode, **kw)

    FlakyMemoryFS.protocol = protocol
    fsspec.register_implementation(protocol, FlakyMemoryFS, clobber=True)
    return FlakyMemoryFS
