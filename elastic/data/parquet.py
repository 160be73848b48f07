"""A map-style dataset over Parquet files on any fsspec URI (s3://, file://, memory://).

    from elastic.data.parquet import ParquetDataset
    ds = ParquetDataset("s3://bucket/corpus/*.parquet", columns=["x", "y"],
                        storage_options={"endpoint_url": "http://minio:9000"})
    len(ds)      # total rows, from the files' footers only
    ds[123456]   # (x, y): global row 123456, read from the one row group that holds it

Rows are numbered across the matched files in path order, then row groups in
file order, so an index names the same row on every node and at every world
size: `elastic.data.order.GlobalOrder` gives the exact-once guarantee on top.

What is read, and when: building the dataset lists the files and reads each
file's footer (one ranged request per file, all files at once on object
stores); no data page is decoded. `ds[i]` reads the byte range of one row
group's selected column chunks (one ranged request) and decodes it; a small LRU
of decoded row groups per process means neighbouring indices cost nothing.
`prefetch(indices)` starts that work in a background thread, and
`__getitems__(indices)` (which torch's DataLoader uses) fetches every row group
a batch needs in one concurrent call.

Pickling keeps only plain data (paths, sizes, row counts): the filesystem,
footers and cache are rebuilt lazily in the process that reads. A file whose
row counts differ from those recorded when the dataset was built is an error,
since the sample order would silently change.
"""
from __future__ import annotations

import bisect
import glob as _glob
import hashlib
import json
import logging
import operator
import posixpath
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import pyarrow.parquet as pq
import torch

from elastic.data.parquet_row_group import DecodedGroup, Window, decode_column
from elastic.config.secrets import redact_uri, secret_values
from elastic.storage import Storage, StorageError, normalize_uri, scrubbed_error

__all__ = ["ParquetDataset"]

logger = logging.getLogger(__name__)

# pyarrow reads this much of a file's tail to find the footer; reading the same
# window ourselves makes footer parsing one ranged request (a longer footer
# costs one more).
_TAIL_BYTES = 64 * 1024
_MAGIC = b"PAR1"


class ParquetDataset(torch.utils.data.Dataset):
    """Rows of the Parquet files at `uri`, by global index, as tuples in `columns` order.

    Args:
        uri: an fsspec URI: one file, a folder (every ``*.parquet`` under it), or a
            glob (``s3://bucket/prefix/*.parquet``). A bare path is a local path.
        columns: the columns to return, in this order; all of them (in the schema's
            order) by default. Every file must have them, with the same types.
        storage_options: passed to fsspec (``endpoint_url``, ``key``, ``secret``,
            ``client_kwargs``...), as ``checkpoint.storage_options`` is.
        cache_row_groups: decoded row groups kept per process (LRU).

    Each value of a row becomes: a numeric or boolean scalar -> a 0-d tensor; a
    list or fixed-size list of numbers -> a 1-D tensor; anything else (strings,
    timestamps...) -> the Python value. So ``default_collate`` batches the rows.
    Nulls in a numeric column are an error (a tensor cannot hold them).
    """

    def __init__(self, uri: str, columns: Sequence[str] | None = None,
                 storage_options: dict[str, Any] | None = None, *, cache_row_groups: int = 8):
        if not isinstance(uri, str) or not uri:
            raise ValueError(f"ParquetDataset: uri must be a non-empty string (an fsspec URI), got {uri!r}")
        if isinstance(columns, str):
            raise ValueError(f"ParquetDataset {uri}: columns must be a list of names, "
                             f"got the string {columns!r}; write columns=[{columns!r}]")
        if int(cache_row_groups) < 1:
            raise ValueError(f"ParquetDataset {uri}: cache_row_groups must be >= 1, got {cache_row_groups}")
        self.uri = normalize_uri(uri)
        self.storage_options = dict(storage_options or {})
        self.cache_row_groups = int(cache_row_groups)
        self._init_transient()

        self._paths, self._sizes = self._list_files()
        self._tail_crcs: dict[int, int] = {}  # file -> crc32 of its last _TAIL_BYTES, read while building
        self.files = [self._fs.unstrip_protocol(p) for p in self._paths]
        self._read_footers(range(len(self._paths)))
        self.columns = self._check_columns(columns)

        # The row counts of every row group of every file: what fixes the global
        # numbering, recorded so a process that re-reads a footer can check it.
        self._file_rows = [tuple(self._footers[f].row_group(r).num_rows
                                 for r in range(self._footers[f].num_row_groups))
                           for f in range(len(self._paths))]
        self._groups: list[tuple[int, int]] = []  # (file, row group), empty row groups left out
        self._starts: list[int] = []              # global index of each group's first row
        total = 0
        for f, rows in enumerate(self._file_rows):
            for r, n in enumerate(rows):
                if n > 0:
                    self._groups.append((f, r))
                    self._starts.append(total)
                    total += n
        self._num_rows = total
        self._fingerprint = self._fingerprint_of_files()
        del self._tail_crcs

    # ------------------------------------------------------------ pickling
    def _init_transient(self) -> None:
        """Per-process state, never pickled: the filesystem, parsed footers, decoded row groups."""
        self._fs_obj = None
        self._footers: dict[int, pq.FileMetaData] = {}
        self._cache: OrderedDict[int, Future] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in ("_fs_obj", "_footers", "_cache", "_lock"):
            del state[k]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_transient()

    @property
    def _fs(self):
        if self._fs_obj is None:
            self._fs_obj = Storage(self.uri, self.storage_options).fs
        return self._fs_obj

    # ------------------------------------------------------------ public API
    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, index: int) -> tuple:
        g, row = self._locate(index)
        return self._row_groups([g])[g].row(row)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple]:
        """Rows at `indices`, fetching every row group they need in one concurrent read."""
        located = [self._locate(i) for i in indices]
        decoded = self._row_groups([g for g, _ in located])
        return [decoded[g].row(row) for g, row in located]

    def prefetch(self, indices: Iterable[int]) -> Future:
        """Start reading the row groups that hold `indices` in a background thread, and return.

        A later ``ds[i]`` for one of them waits for that read rather than starting
        its own. At most ``cache_row_groups`` row groups are prefetched (more would
        evict each other before use). A failed prefetch raises nothing here: the
        returned future holds the error, and the read that needs the rows retries.
        """
        groups = list(dict.fromkeys(self._locate(i)[0] for i in indices))[:self.cache_row_groups]
        done: Future = Future()

        def run():
            try:
                self._row_groups(groups)
                done.set_result(None)
            except BaseException as e:  # noqa: BLE001 - reported through the future
                logger.debug("prefetch of row groups %s of %s failed: %r", groups, self.uri, e)
                done.set_exception(e)

        threading.Thread(target=run, name="elastic-parquet-prefetch", daemon=True).start()
        return done

    def fingerprint(self) -> str:
        """What the resume check compares (elastic/data/fingerprint.py): the files' paths below the
        folder they share, their sizes, the crc32 of each one's last 64 KiB (its footer: schema, row
        groups, column chunk sizes and statistics) and the selected columns. Computed from what
        building the dataset read; nothing is read now. The same files copied to another bucket or
        folder have the same fingerprint; a shard rewritten with other rows has another."""
        return self._fingerprint

    def _fingerprint_of_files(self) -> str:
        base = posixpath.commonpath([posixpath.dirname(p) for p in self._paths])
        h = hashlib.sha256(json.dumps(self.columns).encode())
        for f, path in enumerate(self._paths):
            h.update(json.dumps([posixpath.relpath(path, base) if base else path, self._sizes[f],
                                 self._tail_crcs[f]]).encode())
        return f"parquet:{len(self._paths)}:{h.hexdigest()[:16]}"

    @property
    def num_row_groups(self) -> int:
        """Non-empty row groups across all files."""
        return len(self._groups)

    def __repr__(self) -> str:
        return (f"ParquetDataset({redact_uri(self.uri)!r}, columns={self.columns!r}: {self._num_rows} rows in "
                f"{len(self._groups)} row groups of {len(self.files)} files)")

    # ------------------------------------------------------------ building
    def _list_files(self) -> tuple[list[str], list[int]]:
        fs = self._fs
        path = fs._strip_protocol(self.uri)
        try:
            if _glob.has_magic(path):
                found = fs.glob(path, detail=True)
            elif fs.isdir(path):
                found = {p: d for p, d in fs.find(path, detail=True).items() if p.endswith(".parquet")}
            elif fs.exists(path):
                found = {path: fs.info(path)}
            else:
                found = {}
        except Exception as e:  # noqa: BLE001
            raise self._error(f"ParquetDataset: listing {self.uri} failed: {type(e).__name__}: {e}", e)
        files = sorted((p, int(d.get("size") or 0)) for p, d in found.items() if d.get("type") != "directory")
        if not files:
            raise ValueError(f"ParquetDataset: no Parquet files match {self.uri}: check the URI (and "
                             "storage_options); give a file, a folder (every *.parquet under it is read) "
                             "or a glob such as s3://bucket/prefix/*.parquet")
        return [p for p, _ in files], [s for _, s in files]

    def _read_footers(self, file_indices: Iterable[int]) -> None:
        """Parse the footers of these files (one concurrent ranged read of their tails)."""
        todo = [f for f in file_indices if f not in self._footers]
        if not todo:
            return
        for f in todo:
            if self._sizes[f] < 12:
                raise ValueError(f"ParquetDataset {self.uri}: {self._uri_of(f)} is not a Parquet file "
                                 f"({self._sizes[f]} bytes); narrow the URI, e.g. to *.parquet")
        starts = [max(0, self._sizes[f] - _TAIL_BYTES) for f in todo]
        tails = self._cat_ranges([self._paths[f] for f in todo], starts, [self._sizes[f] for f in todo])
        expected = self.__dict__.get("_file_rows")  # set once built: a re-read is checked against it
        for f, start, tail in zip(todo, starts, tails, strict=True):
            if expected is None:  # building: the tail (footer and all) goes into the fingerprint
                self._tail_crcs[f] = zlib.crc32(tail)
            footer, problem = None, "no PAR1 footer"
            if tail[-4:] == _MAGIC:
                try:
                    footer = pq.read_metadata(Window(self._fs, self._paths[f], self._sizes[f], start, tail))
                except Exception as e:  # noqa: BLE001
                    problem = f"cannot read its footer: {type(e).__name__}: {e}"
            if expected is not None:
                # The file was a good Parquet file with these sizes when the dataset was built.
                rows = None if footer is None else tuple(
                    footer.row_group(r).num_rows for r in range(footer.num_row_groups))
                if rows != expected[f]:
                    now = problem if rows is None else f"row groups of {list(rows)} rows"
                    raise ValueError(
                        f"ParquetDataset {self.uri}: {self._uri_of(f)} changed since the dataset was built "
                        f"({now}; was {self._sizes[f]} bytes in row groups of {list(expected[f])} rows): the "
                        "sample order would change; never rewrite the shards of a running job")
            elif footer is None:
                raise ValueError(f"ParquetDataset {self.uri}: {self._uri_of(f)} is not a Parquet file "
                                 f"({problem}); narrow the URI, e.g. to *.parquet")
            self._footers[f] = footer

    def _check_columns(self, columns: Sequence[str] | None) -> list[str]:
        # Files without rows contribute nothing, and writers often give them other types (null
        # for an empty string column): the schema is that of the files that hold rows.
        with_rows = [f for f in range(len(self._paths)) if self._footers[f].num_rows > 0] or [0]
        first = with_rows[0]
        schema0 = self._footers[first].schema.to_arrow_schema()
        if columns is None:
            columns = list(schema0.names)
        columns = list(columns)
        if not columns or not all(isinstance(c, str) for c in columns):
            raise ValueError(f"ParquetDataset {self.uri}: columns must be a non-empty list of column "
                             f"names, got {columns!r}; the files have {schema0.names}")
        if len(set(columns)) != len(columns):
            raise ValueError(f"ParquetDataset {self.uri}: columns={columns} names a column twice")
        for f in with_rows:
            schema = self._footers[f].schema.to_arrow_schema()
            for c in columns:
                if c not in schema.names:
                    raise ValueError(f"ParquetDataset {self.uri}: column {c!r} is not in {self._uri_of(f)}; "
                                     f"its columns are {schema.names}; fix columns=[...]")
                if schema.field(c).type != schema0.field(c).type:
                    raise ValueError(f"ParquetDataset {self.uri}: column {c!r} is {schema.field(c).type} in "
                                     f"{self._uri_of(f)} but {schema0.field(c).type} in {self.files[first]}; "
                                     "write every shard with the same schema")
        return columns

    # ------------------------------------------------------------ reading
    def _locate(self, index: int) -> tuple[int, int]:
        """(group, row within the group) of global row `index` (negative counts from the end)."""
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"ParquetDataset index must be an integer, got {type(index).__name__}") from None
        if i < 0:
            i += self._num_rows
        if not 0 <= i < self._num_rows:
            raise IndexError(f"ParquetDataset index {index} out of range: {self.uri} holds "
                             f"{self._num_rows} rows (0..{self._num_rows - 1})")
        g = bisect.bisect_right(self._starts, i) - 1
        return g, i - self._starts[g]

    def _row_groups(self, groups: Sequence[int]) -> dict[int, DecodedGroup]:
        """Decoded row groups, from the cache, from a read already in flight, or read now (all the
        missing ones in one concurrent request)."""
        mine: list[int] = []
        futures: dict[int, Future] = {}
        with self._lock:
            for g in dict.fromkeys(groups):
                fut = self._cache.get(g)
                if fut is None:
                    fut = self._cache[g] = Future()
                    mine.append(g)
                else:
                    self._cache.move_to_end(g)
                futures[g] = fut
            while len(self._cache) > self.cache_row_groups:
                self._cache.popitem(last=False)
        if mine:
            try:
                loaded = self._load(mine)
            except BaseException as e:
                with self._lock:
                    for g in mine:
                        futures[g].set_exception(e)
                        if self._cache.get(g) is futures[g]:
                            del self._cache[g]
                raise
            for g in mine:
                futures[g].set_result(loaded[g])
        out = {}
        for g, fut in futures.items():
            try:
                out[g] = fut.result()
            except Exception:  # noqa: BLE001
                if g in mine:
                    raise
                # Another thread's read of it failed (a prefetch): read it ourselves.
                out[g] = self._row_groups([g])[g]
        return out

    def _load(self, groups: list[int]) -> dict[int, DecodedGroup]:
        self._read_footers({self._groups[g][0] for g in groups})
        spans = [self._span(g) for g in groups]
        blobs = self._cat_ranges([self._paths[self._groups[g][0]] for g in groups],
                                 [s for s, _ in spans], [e for _, e in spans])
        out = {}
        for g, (start, _), blob in zip(groups, spans, blobs, strict=True):
            f, r = self._groups[g]
            window = Window(self._fs, self._paths[f], self._sizes[f], start, blob)
            try:
                pf = pq.ParquetFile(window, metadata=self._footers[f], pre_buffer=False)
                table = pf.read_row_group(r, columns=self.columns, use_threads=False)
            except Exception as e:  # noqa: BLE001
                raise self._error(f"ParquetDataset: reading row group {r} of {self._uri_of(f)} failed: "
                                  f"{type(e).__name__}: {e}", e)
            out[g] = DecodedGroup([decode_column(c, table.column(c),
                                                 f"row group {r} of {self._uri_of(f)}")
                                   for c in self.columns])
        return out

    def _span(self, g: int) -> tuple[int, int]:
        """Byte range [start, end) of group g's column chunks for the selected columns."""
        f, r = self._groups[g]
        rg = self._footers[f].row_group(r)
        start, end = None, None
        for j in range(rg.num_columns):
            chunk = rg.column(j)
            top = chunk.path_in_schema
            # A leaf belongs to column c if its dotted path is c or starts with "c.": a top-level
            # name with a dot in it can only widen the range, never miss bytes.
            if not any(top == c or top.startswith(c + ".") for c in self.columns):
                continue
            first = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            last = first + chunk.total_compressed_size
            start = first if start is None else min(start, first)
            end = last if end is None else max(end, last)
        if start is None:  # cannot happen for a checked column; read the whole group then
            return 0, self._sizes[f]
        return max(0, start), min(end, self._sizes[f])

    def _cat_ranges(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        try:
            return self._fs.cat_ranges(paths, starts, ends, on_error="raise")
        except Exception as e:  # noqa: BLE001
            names = ", ".join(sorted({self._fs.unstrip_protocol(p) for p in paths})[:3])
            raise self._error(f"ParquetDataset: reading {names}{' ...' if len(set(paths)) > 3 else ''} "
                              f"failed: {type(e).__name__}: {e}", e)

    def _error(self, message: str, cause: BaseException) -> StorageError:
        """A storage failure whose message quotes none of storage_options' credentials."""
        return scrubbed_error(message, cause, secret_values(self.storage_options, self.uri))

    def _uri_of(self, f: int) -> str:
        return self._fs.unstrip_protocol(self._paths[f])
