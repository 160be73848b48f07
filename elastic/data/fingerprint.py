"""A dataset's fingerprint: what tells the resume check one dataset from another of the same length.

A checkpoint's data cursor is a position in the sample order, and the order is a function of the
dataset's length: another dataset of that length would pass a check of the length alone and be
trained from the middle. Each checkpoint's manifest records the fingerprint of the dataset it was
written with (`data_order["dataset_fingerprint"]`), and the driver refuses a resume whose dataset
has another one, before any worker starts (elastic/trainer.py).

The user's hook: a dataset with a `fingerprint()` method is asked for it. It returns a non-empty
string that changes when the samples do, and is the same in every process that builds the same
data (file names and versions, a content hash, a dataset release...). `ParquetDataset` has one.

Any other dataset is fingerprinted by its length and a hash of `NUM_SAMPLED` items at fixed
positions, each read with Python's, NumPy's and torch's generators seeded for it (random
augmentation repeats). Tensors, NumPy arrays, numbers, strings, bytes, None, lists, tuples and
dicts of them are hashed by value; anything with `__array__` (a PIL image) as its array; any
other object by its type's name only, with a warning that the sample check is partial there.
"""
from __future__ import annotations

import hashlib
import logging
import random
import struct
from collections.abc import Mapping
from contextlib import contextmanager

import numpy as np
import torch

log = logging.getLogger(__name__)

NUM_SAMPLED = 8  # items read for a dataset without fingerprint(): enough to tell datasets apart, cheap to read
KEY = "dataset_fingerprint"  # its key in a manifest's data_order


def has_hook(dataset) -> bool:
    """Whether the dataset brings its own fingerprint()."""
    return callable(getattr(dataset, "fingerprint", None))


def dataset_fingerprint(dataset) -> str:
    """The dataset's fingerprint: "user:" + its own `fingerprint()`, else "sample:" + its length
    and a hash of its items at `sample_positions`. Raises what the dataset raises, and ValueError
    for a `fingerprint()` that returns no string."""
    if has_hook(dataset):
        fp = dataset.fingerprint()
        if not isinstance(fp, str) or not fp:
            raise ValueError(f"fingerprint() returned {fp!r}: it must return a non-empty string")
        return f"user:{fp}"
    n = len(dataset)
    h = hashlib.sha256()
    opaque: set[str] = set()
    for i in sample_positions(n):
        with _seeded(i):
            item = dataset[i]
        _encode(item, h, opaque)
    if opaque:
        log.warning("the dataset's items hold %s, fingerprinted by type only: the resume check tells datasets "
                    "apart by their other values and length; give the dataset a fingerprint() method to cover "
                    "them (docs/data.md)", ", ".join(sorted(opaque)))
    return f"sample:{n}:{h.hexdigest()[:16]}"


def fingerprint_or_none(dataset) -> str | None:
    """`dataset_fingerprint` as a rank records it: None (logged) where it raises, and the
    checkpoints it writes then let a resume check the length alone."""
    try:
        return dataset_fingerprint(dataset)
    except Exception as e:  # noqa: BLE001 - the driver reported the user's error already; train on
        log.warning("the dataset's fingerprint raised %s: %s; checkpoints record none", type(e).__name__, e)
        return None


def sample_positions(n: int) -> list[int]:
    """Up to NUM_SAMPLED positions spread over [0, n): the first, the last and evenly between."""
    if n <= 0:
        return []
    return sorted({k * (n - 1) // (NUM_SAMPLED - 1) for k in range(NUM_SAMPLED)})


@contextmanager
def _seeded(seed: int):
    """Python's, NumPy's and torch's CPU generators seeded for one read, and put back after it: the
    driver's and a rank's generators are where they were (a rank seeds its own per step anyway)."""
    saved = random.getstate(), np.random.get_state(), torch.default_generator.get_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.default_generator.set_state(saved[2])


def _bytes(h, tag: bytes, data: bytes) -> None:
    h.update(tag + struct.pack("<Q", len(data)) + data)


def _encode(x, h, opaque: set[str]) -> None:
    """Feed `x` to `h` in an encoding that is the same in every process and every run: a tag per
    kind, lengths before contents (so [1, 2] and [12] differ), no memory addresses or hash seeds."""
    if x is None:
        h.update(b"N")
    elif isinstance(x, bool):
        h.update(b"B1" if x else b"B0")
    elif isinstance(x, int):
        _bytes(h, b"I", str(x).encode())
    elif isinstance(x, float):
        _bytes(h, b"F", x.hex().encode())
    elif isinstance(x, complex):
        _bytes(h, b"C", f"{x.real.hex()},{x.imag.hex()}".encode())
    elif isinstance(x, str):
        _bytes(h, b"S", x.encode("utf-8", "surrogatepass"))
    elif isinstance(x, (bytes, bytearray, memoryview)):
        _bytes(h, b"Y", bytes(x))
    elif isinstance(x, torch.Tensor):
        _tensor(x, h, opaque)
    elif isinstance(x, (np.ndarray, np.generic)):
        _array(np.asarray(x), h, opaque)
    elif isinstance(x, Mapping):
        _bytes(h, b"D", str(len(x)).encode())
        items = []
        for k, v in x.items():
            kh = hashlib.sha256()
            _encode(k, kh, opaque)
            items.append((kh.digest(), v))
        for kd, v in sorted(items, key=lambda kv: kv[0]):  # any key order, one encoding
            h.update(kd)
            _encode(v, h, opaque)
    elif isinstance(x, (list, tuple)):
        _bytes(h, b"L" if isinstance(x, list) else b"U", str(len(x)).encode())
        for v in x:
            _encode(v, h, opaque)
    elif hasattr(x, "__array__") or hasattr(x, "__array_interface__"):
        try:
            arr = np.asarray(x)
        except Exception:  # noqa: BLE001 - an object that only claims to be an array
            _opaque(x, h, opaque)
        else:
            _array(arr, h, opaque)
    else:
        _opaque(x, h, opaque)


def _tensor(t: torch.Tensor, h, opaque: set[str]) -> None:
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        _opaque(t, h, opaque)
        return
    flat = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    _bytes(h, b"T", f"{t.dtype}{tuple(t.shape)}".encode())
    # As bytes, whatever the dtype (bfloat16 has no NumPy type).
    _bytes(h, b"", flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")


def _array(a: np.ndarray, h, opaque: set[str]) -> None:
    if a.dtype.hasobject:
        _bytes(h, b"O", str(a.shape).encode())
        for v in a.flat:
            _encode(v, h, opaque)
        return
    _bytes(h, b"A", f"{a.dtype.str}{a.shape}".encode())
    _bytes(h, b"", np.ascontiguousarray(a).tobytes())


def _opaque(x, h, opaque: set[str]) -> None:
    name = f"{type(x).__module__}.{type(x).__qualname__}"
    opaque.add(name)
    _bytes(h, b"X", name.encode())
