"""ParquetDataset: global row numbering across files and row groups, what is read when, errors,
pickling, prefetch; the charlm Parquet example against NextCharDataset, locally and on real S3."""

from __future__ import annotations

import io
import pickle
import random
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch.utils.data import DataLoader, default_collate

from elastic.data.parquet import ParquetDataset
from elastic.storage import StorageError
from examples import parquet_corpus
from examples.charlm import CONTEXT, NextCharDataset

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def mem():
    """A fresh memory:// folder, removed afterwards (the memory filesystem is process-wide)."""
    uri = f"memory://pq-{uuid.uuid4().hex[:8]}"
    yield uri
    fs = fsspec.filesystem("memory")
    if fs.exists(uri):
        fs.rm(uri, recursive=True)


@pytest.fixture(scope="module")
def charlm():
    return NextCharDataset()


def _table(first: int, n: int) -> pa.Table:
    """Rows first..first+n-1; every column derives from the global row number g."""
    g = np.arange(first, first + n, dtype=np.int64)
    return pa.table({
        "g": pa.array(g),
        "v": pa.ListArray.from_arrays(pa.array(np.arange(0, 3 * n + 1, 3, dtype=np.int32)),
                                      pa.array((np.repeat(g, 3) + np.tile([0.0, 0.5, 0.25], n)).astype(np.float32))),
        "f": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(g, 2).astype(np.int32)), 2),
        "r": pa.array([list(range(int(k) % 3)) for k in g], type=pa.list_(pa.int64())),
        "s": pa.array([f"row {k}" for k in g], type=pa.string()),
        "b": pa.array(g % 2 == 0),
    })


def _write(uri: str, name: str, table: pa.Table, row_group_size: int = 4) -> str:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size)
    path = f"{uri}/{name}"
    with fsspec.open(path, "wb") as f:
        f.write(buf.getvalue())
    return path


def _shards(uri: str, sizes=(10, 0, 7, 13), row_group_size: int = 4) -> int:
    """Files part-0.parquet... of these row counts (an empty one included), written out of path
    order; returns the total number of rows."""
    first, files = 0, []
    for k, n in enumerate(sizes):
        files.append((f"part-{k}.parquet", _table(first, n)))
        first += n
    for name, table in reversed(files):  # creation order must not matter
        _write(uri, name, table, row_group_size)
    return first


def _expect(ds_row, g: int, columns=("g", "v", "f", "r", "s", "b")):
    want = {"g": torch.tensor(g), "v": torch.tensor([g, g + 0.5, g + 0.25], dtype=torch.float32),
            "f": torch.tensor([g, g], dtype=torch.int32), "r": torch.arange(g % 3), "s": f"row {g}",
            "b": torch.tensor(g % 2 == 0)}
    assert isinstance(ds_row, tuple) and len(ds_row) == len(columns)
    for c, got in zip(columns, ds_row, strict=True):
        if c == "s":
            assert got == want[c]
        else:
            assert got.dtype == want[c].dtype and got.shape == want[c].shape and torch.equal(got, want[c]), (c, g, got)


class _Spy:
    """Records the byte ranges read from the memory filesystem under `root` (the test's own folder:
    the filesystem is process-wide, and a thread an earlier test left behind, a controller's lease
    renewal, reads its own files there; CI once counted two such reads here)."""

    def __init__(self, monkeypatch, root: str):
        self.reads: list[tuple[str, int | None, int | None]] = []
        original = MemoryFileSystem.cat_file
        mine = MemoryFileSystem._strip_protocol(root).rstrip("/") + "/"

        def cat_file(fs, path, start=None, end=None, **kw):
            stripped = fs._strip_protocol(path)
            if stripped.startswith(mine):
                self.reads.append((stripped, start, end))
            return original(fs, path, start=start, end=end, **kw)

        monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)


# ---------------------------------------------------------------- numbering and values
def test_rows_across_files_and_row_groups(mem):
    total = _shards(mem)
    ds = ParquetDataset(f"{mem}/*.parquet")
    assert len(ds) == total == 30
    assert ds.columns == ["g", "v", "f", "r", "s", "b"]
    assert ds.files == [f"memory:///{mem[len('memory://'):]}/part-{k}.parquet" for k in range(4)]
    assert ds.num_row_groups == 3 + 2 + 4  # 10, 7 and 13 rows in groups of 4; the empty file has none
    for g in random.Random(0).sample(range(total), total):  # every row, in random order
        _expect(ds[g], g)
    _expect(ds[-1], total - 1)
    _expect(ds[np.int64(11)], 11)
    _expect(ds[torch.tensor(12)], 12)


def test_columns_select_and_order(mem):
    _shards(mem)
    ds = ParquetDataset(mem, columns=["s", "g"])
    _expect(ds[17], 17, columns=("s", "g"))
    ds = ParquetDataset(mem, columns=["v"])
    _expect(ds[3], 3, columns=("v",))


def test_default_collate_and_getitems(mem):
    _shards(mem, sizes=(10, 7, 13))
    ds = ParquetDataset(mem, columns=["g", "v", "f", "b"])
    idx = [29, 0, 4, 3, 17, 9, 10]  # across files and row-group boundaries
    batch = ds.__getitems__(idx)
    assert all(torch.equal(a, b) for got, i in zip(batch, idx, strict=True) for a, b in zip(got, ds[i], strict=True))
    g, v, f, b = default_collate(batch)
    assert torch.equal(g, torch.tensor(idx)) and v.shape == (7, 3) and f.shape == (7, 2) and b.dtype == torch.bool
    loader = DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    seen = torch.cat([g for g, *_ in loader])
    assert sorted(seen.tolist()) == list(range(30))


def test_files_are_sorted_by_path_and_a_folder_reads_its_parquet_files(tmp_path):
    folder = tmp_path / "shards"
    _shards(f"file://{folder}", sizes=(5, 6))
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / "sub").mkdir()
    _write(f"file://{folder}/sub", "part-9.parquet", _table(11, 3))
    for uri in (str(folder), f"file://{folder}", f"file://{folder}/"):
        ds = ParquetDataset(uri)
        assert len(ds) == 14 and [f.rsplit("/", 1)[1] for f in ds.files] == ["part-0.parquet", "part-1.parquet",
                                                                              "part-9.parquet"]
        assert all(ds[g][0].item() == g for g in range(14))
    one = ParquetDataset(f"{folder}/part-1.parquet")
    assert len(one) == 6 and one[0][0].item() == 5


# ---------------------------------------------------------------- what is read
def test_len_reads_footers_only(mem, monkeypatch):
    # Two files big enough that their data pages lie outside the tail window, the first with
    # its data pages overwritten with garbage: building and len() never touch them.
    big = _table(0, 20_000).select(["g", "f"])
    path = _write(mem, "a.parquet", big, row_group_size=5_000)
    _write(mem, "b.parquet", _table(20_000, 20_000).select(["g", "f"]), row_group_size=5_000)
    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat_file(path))
    data[4:30_000] = b"\xff" * 29_996
    fs.pipe_file(path, bytes(data))
    spy = _Spy(monkeypatch, mem)

    ds = ParquetDataset(mem, columns=["g", "f"])
    assert len(ds) == 40_000 and ds.num_row_groups == 8
    sizes = {p: fs.size(p) for p, _, _ in spy.reads}
    assert len(spy.reads) == 2 and all(end == sizes[p] and end - start <= 64 * 1024 and start > 30_000
                                       for p, start, end in spy.reads), spy.reads
    _expect(ds[25_000], 25_000, columns=("g", "f"))
    with pytest.raises(StorageError, match="row group 0 of memory:///.*/a.parquet"):
        ds[0]


def test_getitem_reads_only_its_row_group_and_caches_it(mem, monkeypatch):
    _shards(mem, sizes=(10, 7, 13))
    ds = ParquetDataset(mem, columns=["g", "v"])
    spy = _Spy(monkeypatch, mem)
    ds[19]  # file 2, its first row group (rows 17..20)
    assert len(spy.reads) == 1
    path, start, end = spy.reads[0]
    assert path.endswith("/part-2.parquet")
    rg = pq.ParquetFile(fsspec.open(f"memory://{path}").open()).metadata.row_group(0)
    chunks = [rg.column(j) for j in range(rg.num_columns) if rg.column(j).path_in_schema.split(".")[0] in ("g", "v")]
    lo = min(c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks)
    hi = max((c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset) + c.total_compressed_size
             for c in chunks)
    assert (start, end) == (lo, hi)
    _expect(ds[17], 17, columns=("g", "v"))
    _expect(ds[20], 20, columns=("g", "v"))
    assert len(spy.reads) == 1  # same row group: from the cache
    ds[21]
    assert len(spy.reads) == 2


def test_cache_is_bounded_and_rows_are_copies(mem):
    _shards(mem, sizes=(40,))
    ds = ParquetDataset(mem, columns=["g", "v"], cache_row_groups=2)
    for g in range(0, 40, 4):
        ds[g]
    assert list(ds._cache) == [8, 9]
    row = ds[36]
    row[1].zero_()
    _expect(ds[36], 36, columns=("g", "v"))
    assert all(ds.__getitems__(range(40))[g][0].item() == g for g in range(40))  # more groups than the cache holds


def test_prefetch_reads_ahead_and_a_failed_prefetch_is_retried(mem, monkeypatch):
    _shards(mem, sizes=(10, 7, 13))
    ds = ParquetDataset(mem, columns=["g"])
    spy = _Spy(monkeypatch, mem)
    assert ds.prefetch([0, 1, 12, 29]).result(timeout=30) is None
    assert len(spy.reads) == 3  # three row groups
    assert [ds[i][0].item() for i in (0, 1, 12, 29, 2)] == [0, 1, 12, 29, 2]
    assert len(spy.reads) == 3

    def broken(*a, **kw):
        raise ConnectionError("storage is down")

    monkeypatch.setattr(MemoryFileSystem, "cat_ranges", broken)
    with pytest.raises(StorageError, match="storage is down"):
        ds.prefetch([5]).result(timeout=30)
    monkeypatch.undo()
    assert ds[5][0].item() == 5


# ---------------------------------------------------------------- errors
def test_errors_name_the_problem_and_what_to_do(mem, tmp_path):
    with pytest.raises(ValueError, match=r"no Parquet files match memory://nothing-here/\*\.parquet.*glob"):
        ParquetDataset("memory://nothing-here/*.parquet")
    with pytest.raises(ValueError, match="no Parquet files match file://"):
        ParquetDataset(str(tmp_path / "missing"))
    _shards(mem, sizes=(10, 7))
    with pytest.raises(ValueError, match=r"column 'z' is not in .*part-0.parquet; its columns are "
                                         r"\['g', 'v', 'f', 'r', 's', 'b'\]"):
        ParquetDataset(mem, columns=["g", "z"])
    with pytest.raises(ValueError, match=r"columns=\['x'\]"):
        ParquetDataset(mem, columns="x")
    with pytest.raises(ValueError, match="cache_row_groups must be >= 1"):
        ParquetDataset(mem, cache_row_groups=0)
    ds = ParquetDataset(mem, columns=["g"])
    for bad in (17, -18, 10**9):
        with pytest.raises(IndexError, match=rf"index {bad} out of range: .* holds 17 rows \(0\.\.16\)"):
            ds[bad]
    with pytest.raises(TypeError, match="must be an integer, got float"):
        ds[1.0]

    fsspec.filesystem("memory").pipe_file(f"{mem}/notes.txt", b"not parquet at all")
    with pytest.raises(ValueError, match=r"notes.txt is not a Parquet file .*narrow the URI"):
        ParquetDataset(f"{mem}/*")

    other = f"{mem}-types"
    _write(other, "a.parquet", pa.table({"x": pa.array([1, 2], type=pa.int64())}))
    _write(other, "b.parquet", pa.table({"x": pa.array([1.0, 2.0])}))
    with pytest.raises(ValueError, match=r"column 'x' is double in .*b.parquet but int64 in .*a.parquet"):
        ParquetDataset(other)
    fsspec.filesystem("memory").rm(other, recursive=True)


def test_nulls_in_a_numeric_column_are_an_error_on_read(mem):
    _write(mem, "a.parquet", pa.table({"x": pa.array([1, None, 3]), "s": pa.array(["a", None, "c"])}))
    ds = ParquetDataset(mem)
    assert len(ds) == 3
    with pytest.raises(ValueError, match=r"column 'x' has nulls in row group 0 of .*a.parquet.*fill them"):
        ds[0]
    assert ParquetDataset(mem, columns=["s"])[1] == (None,)


# ---------------------------------------------------------------- pickling
def test_pickles_without_handles_and_rebuilds_lazily(tmp_path):
    uri = f"file://{tmp_path}"
    _shards(uri, sizes=(10, 7, 13))
    ds = ParquetDataset(uri, columns=["g", "v", "s"])
    ds[3], ds[25]  # fill the cache and parse footers
    blob = pickle.dumps(ds)
    assert len(blob) < 4096  # paths and row counts, no footers or decoded rows
    copy = pickle.loads(blob)
    assert copy._fs_obj is None and not copy._footers and not copy._cache
    assert len(copy) == 30 and all(copy[g][0].item() == g for g in range(30))
    assert len(copy._footers) == 3

    # A shard rewritten with other row counts after the dataset was built: the numbering would
    # silently change, so reading it is an error.
    stale = pickle.loads(blob)
    _write(uri, "part-1.parquet", _table(10, 7), row_group_size=2)
    _expect(stale[3], 3, columns=("g", "v", "s"))  # other files are unaffected
    with pytest.raises(ValueError, match=r"part-1.parquet changed since the dataset was built"):
        stale[12]


# ---------------------------------------------------------------- fingerprint
def test_fingerprint_follows_the_files_content_not_their_folder(mem, monkeypatch):
    """What the resume check compares (elastic/data/fingerprint.py): taken from what building read
    (no read of its own), the same for a copy of the files elsewhere, another for a shard
    rewritten with other values of the same length and row groups, or other columns."""
    _shards(mem, sizes=(10, 7, 13))
    spy = _Spy(monkeypatch, mem)
    ds = ParquetDataset(mem, columns=["g", "v"])
    reads = len(spy.reads)
    fp = ds.fingerprint()
    assert len(spy.reads) == reads and fp.startswith("parquet:3:")
    assert pickle.loads(pickle.dumps(ds)).fingerprint() == fp  # and in a data worker, unread
    assert ParquetDataset(mem, columns=["g", "v"]).fingerprint() == fp  # built again: the same

    copy = f"memory://pq-{uuid.uuid4().hex[:8]}"
    try:
        _shards(copy, sizes=(10, 7, 13))
        assert ParquetDataset(copy, columns=["g", "v"]).fingerprint() == fp
    finally:
        fsspec.filesystem("memory").rm(copy, recursive=True)
    assert ParquetDataset(mem, columns=["v", "g"]).fingerprint() != fp

    # part-1 rewritten to the same size, in the same row groups, one value changed.
    t = _table(10, 7)
    _write(mem, "part-1.parquet", t.set_column(0, "g", pa.array(np.arange(10, 17) + np.array([0] * 6 + [1]))))
    changed = ParquetDataset(mem, columns=["g", "v"])
    assert changed._sizes == ds._sizes and changed._file_rows == ds._file_rows
    assert changed.fingerprint() != fp


# ---------------------------------------------------------------- the charlm example
def test_example_shards_match_next_char_dataset(tmp_path, monkeypatch, charlm):
    uri = f"file://{tmp_path}/corpus"
    files = parquet_corpus.write_shards(uri, 5, row_group_size=1000)
    assert files == [f"{uri}/part-{k:05d}.parquet" for k in range(5)]
    monkeypatch.setenv(parquet_corpus.URI_ENV, uri)
    ds = parquet_corpus.build_dataset()
    assert len(ds) == len(charlm) and ds.columns == ["x", "y"]
    shard_firsts = [len(charlm) * k // 5 for k in range(5)]
    edges = {e + d for e in shard_firsts + list(range(0, len(charlm), 1000)) for d in (-1, 0, 1)}
    idx = sorted(i for i in edges if 0 <= i < len(charlm)) + random.Random(1).sample(range(len(charlm)), 300)
    for i in idx:
        (x, y), (cx, cy) = ds[i], charlm[i]
        assert x.shape == (CONTEXT,) and x.dtype == cx.dtype and y.shape == cy.shape and y.dtype == cy.dtype
        assert torch.equal(x, cx) and torch.equal(y, cy), i

    # Fewer shards into the same folder: the extra old ones go, the dataset stays the corpus.
    parquet_corpus.write_shards(uri, 2)
    assert len(parquet_corpus.build_dataset().files) == 2
    assert torch.equal(parquet_corpus.build_dataset()[len(charlm) - 1][0], charlm[len(charlm) - 1][0])


def test_example_cli_and_missing_shards_hint(tmp_path, monkeypatch, capsys):
    uri = f"file://{tmp_path}/cli"
    parquet_corpus.main([uri, "--shards", "2", "--row-group-size", "4096"])
    out = capsys.readouterr().out
    assert f"{uri}/part-00001.parquet" in out and "row groups of 2 files" in out
    monkeypatch.setenv(parquet_corpus.URI_ENV, f"file://{tmp_path}/empty")
    with pytest.raises(ValueError, match="write the shards first: python -m examples.parquet_corpus file://"):
        parquet_corpus.build_dataset()
    monkeypatch.setenv(parquet_corpus.OPTIONS_ENV, "{not json")
    with pytest.raises(ValueError, match="ELASTIC_PARQUET_STORAGE_OPTIONS must be a JSON object"):
        parquet_corpus.build_dataset()


# ---------------------------------------------------------------- real S3
@pytest.mark.s3
@pytest.mark.timeout(120)
def test_example_on_seaweedfs(s3_server, monkeypatch, charlm):
    import json

    uri = f"{s3_server.uri}/parquet-{uuid.uuid4().hex[:8]}"
    opts = s3_server.storage_options
    parquet_corpus.write_shards(uri, 4, storage_options=opts, row_group_size=2048)
    monkeypatch.setenv(parquet_corpus.URI_ENV, f"{uri}/*.parquet")
    monkeypatch.setenv(parquet_corpus.OPTIONS_ENV, json.dumps(opts))
    ds = parquet_corpus.build_dataset()
    assert len(ds) == len(charlm) and [f.rsplit("/", 1)[1] for f in ds.files] == [
        f"part-{k:05d}.parquet" for k in range(4)]

    rng = random.Random(2)
    idx = rng.sample(range(len(charlm)), 64)
    assert ds.prefetch(idx[:8]).result(timeout=60) is None
    for i in idx:
        (x, y), (cx, cy) = ds[i], charlm[i]
        assert torch.equal(x, cx) and torch.equal(y, cy), i
    # a copy (as a Ray actor gets it) reads on its own, a whole batch in one concurrent request
    copy = pickle.loads(pickle.dumps(ds))
    batch = rng.sample(range(len(charlm)), 32)
    x, y = default_collate(copy.__getitems__(batch))
    assert torch.equal(x, torch.stack([charlm[i][0] for i in batch]))
    assert torch.equal(y, torch.stack([charlm[i][1] for i in batch]))
    fsspec.filesystem("s3", **opts).rm(uri.removeprefix("s3://"), recursive=True)
