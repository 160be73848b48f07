"""One Parquet row group in memory, for `elastic.data.parquet.ParquetDataset`: the bytes of its
one ranged read, served to pyarrow as a file (`Window`), and its selected columns decoded once
into tensors, or Python values for what a tensor cannot hold (`decode_column`, `DecodedGroup`).
"""
from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch


class Window(io.RawIOBase):
    """A read-only file of `size` bytes of which [start, start + len(data)) is already in memory.

    pyarrow reads row groups through it; a read outside the window (it should not
    happen, as the window covers the selected column chunks) fetches what it needs
    with one ranged request, so a writer's odd offsets cost a request, not a wrong row.
    """

    def __init__(self, fs, path: str, size: int, start: int, data: bytes):
        super().__init__()
        self._fs, self._path, self._size = fs, path, size
        self._start, self._data = start, memoryview(data)  # slices without copying
        self._pos = 0
        self.num_fetches = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        if end <= self._pos:
            return b""
        if self._start <= self._pos and end <= self._start + len(self._data):
            out = self._data[self._pos - self._start:end - self._start]
        else:
            self.num_fetches += 1
            out = self._fs.cat_file(self._path, start=self._pos, end=end)
        self._pos = end
        return out


class DecodedGroup:
    """One row group's selected columns, decoded once into tensors (or Python lists)."""

    def __init__(self, columns: list):
        self._columns = columns

    def row(self, i: int) -> tuple:
        return tuple(c.row(i) for c in self._columns)


class _Dense:
    """Scalars (shape [rows]) or equal-length lists (shape [rows, n]): row i is a tensor."""

    def __init__(self, t: torch.Tensor):
        self._t = t

    def row(self, i: int) -> torch.Tensor:
        # a copy, so that a caller writing into a row cannot change the cached group
        return self._t[i].clone()


class _Ragged:
    """Lists of differing lengths: flat values plus offsets; row i is a 1-D tensor."""

    def __init__(self, values: torch.Tensor, offsets: np.ndarray):
        self._values, self._offsets = values, offsets

    def row(self, i: int) -> torch.Tensor:
        return self._values[int(self._offsets[i]):int(self._offsets[i + 1])].clone()


class _Python:
    def __init__(self, values: list):
        self._values = values

    def row(self, i: int):
        return self._values[i]


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _tensor(arr: pa.Array) -> torch.Tensor:
    a = arr.to_numpy(zero_copy_only=False)
    # arrow buffers are read-only; torch wants memory it may write
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def decode_column(name: str, col: pa.ChunkedArray, where: str):
    arr = col.combine_chunks()
    t = arr.type
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    if not (_is_numeric(t) or (is_list and _is_numeric(t.value_type))):
        return _Python(arr.to_pylist())
    if arr.null_count or (is_list and arr.flatten().null_count):
        raise ValueError(f"ParquetDataset: column {name!r} has nulls in {where}; its rows become tensors, "
                         "which cannot hold them: fill them when writing the shards, or leave the column "
                         "out of columns=[...]")
    if not is_list:
        return _Dense(_tensor(arr))
    values = _tensor(arr.flatten())
    if pa.types.is_fixed_size_list(t):
        return _Dense(values.reshape(len(arr), t.list_size))
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths == lengths[0]).all():
        return _Dense(values.reshape(len(arr), int(lengths[0])))
    return _Ragged(values, np.concatenate([[0], np.cumsum(lengths)]))
