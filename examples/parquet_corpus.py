"""The character-LM corpus of `examples.charlm` as Parquet shards, and a dataset that reads them back.

    python -m examples.parquet_corpus s3://my-bucket/charlm --shards 4 \\
        --storage-options '{"endpoint_url": "http://minio:9000"}'

writes part-00000.parquet ... part-00003.parquet, with columns `x` (list<int64>:
a window of CONTEXT characters) and `y` (int64: the character after it), rows in
`NextCharDataset` order and cut into contiguous shards, so that row i of the
Parquet dataset is sample i of `NextCharDataset`. A job then trains
`examples.charlm:build_model` from them with

    train: {dataset: examples.parquet_corpus:build_dataset, model: examples.charlm:build_model, ...}

`build_dataset()` reads the URI from ELASTIC_PARQUET_URI (default: the local
folder DEFAULT_URI) and fsspec options, as JSON, from
ELASTIC_PARQUET_STORAGE_OPTIONS. Every process that builds the dataset (the
driver and each worker) needs them.
"""
from __future__ import annotations

import argparse
import io
import json
import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from elastic.data.parquet import ParquetDataset
from elastic.storage import Storage, join, normalize_uri
from examples.charlm import CONTEXT, NextCharDataset

DEFAULT_URI = normalize_uri(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         "runs", "charlm-parquet"))
URI_ENV = "ELASTIC_PARQUET_URI"
OPTIONS_ENV = "ELASTIC_PARQUET_STORAGE_OPTIONS"


def samples(stride: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (x, y) of `NextCharDataset(stride)`, in its order: x [N, CONTEXT], y [N]."""
    ds = NextCharDataset(stride)
    windows = ds.starts[:, None] + torch.arange(CONTEXT + 1)
    rows = ds.data[windows]
    return rows[:, :CONTEXT], rows[:, CONTEXT]


def write_shards(uri: str, num_shards: int = 4, *, storage_options: dict[str, Any] | None = None,
                 row_group_size: int = 1024, stride: int = 7) -> list[str]:
    """Write the corpus as `num_shards` Parquet files under `uri`; returns their URIs.

    Shards are contiguous runs of samples named so that path order is sample
    order; each is written whole (one PUT on object stores), and `part-*.parquet`
    files of an earlier, larger split are removed. Row groups of `row_group_size`
    rows keep a random read small.
    """
    if num_shards < 1 or row_group_size < 1:
        raise ValueError(f"num_shards and row_group_size must be >= 1, got {num_shards} and {row_group_size}")
    x, y = samples(stride)
    if num_shards > len(y):
        raise ValueError(f"num_shards={num_shards} is more than the {len(y)} samples")
    storage = Storage(uri, storage_options)
    bounds = [len(y) * k // num_shards for k in range(num_shards + 1)]
    out = []
    for k in range(num_shards):
        lo, hi = bounds[k], bounds[k + 1]
        offsets = pa.array(range(0, (hi - lo) * CONTEXT + 1, CONTEXT), type=pa.int32())
        table = pa.table({
            "x": pa.ListArray.from_arrays(offsets, pa.array(x[lo:hi].reshape(-1).numpy())),
            "y": pa.array(y[lo:hi].numpy()),
        })
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=row_group_size)
        target = join(storage.uri, f"part-{k:05d}.parquet")
        storage.write_bytes(target, buf.getvalue())
        out.append(target)
    # Shards left from an earlier run with more of them would join the dataset.
    for name in storage.list_dir(storage.uri):
        if name.startswith("part-") and name.endswith(".parquet") and join(storage.uri, name) not in out:
            storage.remove_tree(join(storage.uri, name))
    return out


def build_dataset() -> ParquetDataset:
    """The shards at $ELASTIC_PARQUET_URI (default DEFAULT_URI) as (x, y) samples."""
    uri = os.environ.get(URI_ENV) or DEFAULT_URI
    raw = os.environ.get(OPTIONS_ENV) or "{}"
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{OPTIONS_ENV} must be a JSON object of fsspec options: {e}") from e
    try:
        return ParquetDataset(uri, columns=["x", "y"], storage_options=options)
    except ValueError as e:
        if "no Parquet files match" not in str(e):
            raise
        raise ValueError(f"{e}; write the shards first: python -m examples.parquet_corpus {uri}") from e


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples.parquet_corpus", description=__doc__.split("\n")[0])
    p.add_argument("uri", nargs="?", default=DEFAULT_URI, help=f"fsspec URI of the folder (default {DEFAULT_URI})")
    p.add_argument("--shards", type=int, default=4, help="number of Parquet files (default 4)")
    p.add_argument("--row-group-size", type=int, default=1024, help="rows per row group (default 1024)")
    p.add_argument("--stride", type=int, default=7, help="characters between sample starts (default 7)")
    p.add_argument("--storage-options", default="{}", help="fsspec options as JSON, e.g. '{\"endpoint_url\": …}'")
    args = p.parse_args(argv)
    files = write_shards(args.uri, args.shards, storage_options=json.loads(args.storage_options),
                         row_group_size=args.row_group_size, stride=args.stride)
    ds = ParquetDataset(args.uri, columns=["x", "y"], storage_options=json.loads(args.storage_options))
    print(f"wrote {len(ds)} samples in {ds.num_row_groups} row groups of {len(files)} files:")
    for f in files:
        print(f"  {f}")
    print(f"train from them with {URI_ENV}={args.uri} and train.dataset: examples.parquet_corpus:build_dataset")


if __name__ == "__main__":
    main()
