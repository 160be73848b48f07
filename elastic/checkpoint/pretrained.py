"""Pretrained weights for a run that starts fresh (`train.init_from`): a torch state dict (`.pt`,
`.pth`, `.bin`), a safetensors file, or another run's DCP checkpoint (its run folder, its
`checkpoints` folder, or one step folder), read into whatever layout this run has.

Each rank reads what its own tensors hold: for a sharded tensor (FSDP, tensor parallelism) only
its slice (safetensors: the slice's bytes, `safe_open(...).get_slice`; DCP: the saved chunks that
overlap it; a `.pt` is one pickle, mapped with `mmap=True`, so the rank's pages of it are read,
not the file). A remote file (s3://, ...) is copied to a local temporary file first, once per
rank. Names are the model's own (`model.state_dict()`'s); dtypes are cast to the model's.

`check_source` runs on the driver before any worker starts (the file's names and shapes against
the model built on the meta device); `load_into` on every rank, in the fresh-init restore.
"""
from __future__ import annotations

import logging
import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

import fsspec
import torch

from elastic.checkpoint.layout import (COMMIT_MARKER, MANIFEST, checkpoints_root, latest_committed,
                                       manifest_of)
from elastic.config.loading import ConfigError
from elastic.storage import Storage, join, normalize_uri

log = logging.getLogger(__name__)

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
MODEL_PREFIX = "model."  # DCP flattens the state's {"model": {...}} to "model.<name>"
_SHOWN = 8  # names listed in a message, then "and N more"


class PretrainedError(ConfigError):
    """train.init_from cannot be used as given; the message says why and what to do."""


def kind_of(uri: str) -> str:
    path = uri.rstrip("/").lower()
    if path.endswith(".safetensors"):
        return "safetensors"
    if path.endswith(TORCH_SUFFIXES):
        return "torch"
    return "dcp"


def resolve(uri: str, storage_options: dict) -> str:
    """`uri` made absolute; a run folder (or its `checkpoints` folder) becomes its newest committed
    step folder, so every rank reads the same checkpoint however long the run takes to start."""
    uri = normalize_uri(uri)
    if kind_of(uri) != "dcp":
        return uri
    storage = Storage(uri, storage_options)
    if storage.exists(join(uri, COMMIT_MARKER)):
        return uri
    for root in (join(uri, "checkpoints"), uri):
        if storage.exists(root):
            found = latest_committed(storage, root)
            if found is not None:
                return found.uri
    raise PretrainedError(f"train.init_from: {uri} is neither a file (.safetensors, .pt) nor a "
                          f"committed checkpoint folder, nor a run folder with one under "
                          f"checkpoints/")


# ---------------------------------------------------------------- the sources' names and shapes
def source_shapes(uri: str, storage_options: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the source holds, by the model's name, with its shape."""
    kind = kind_of(uri)
    if kind == "dcp":
        meta = _dcp_reader(uri, storage_options).read_metadata().state_dict_metadata
        return {k[len(MODEL_PREFIX):]: tuple(v.size) for k, v in meta.items()
                if k.startswith(MODEL_PREFIX) and hasattr(v, "size")}
    with opened(uri, storage_options) as src:
        return src.shapes()


def model_shapes(model_fn) -> dict[str, tuple[int, ...]] | None:
    """The model's state dict names and shapes, built on the meta device; None where it cannot
    be built there."""
    try:
        with torch.device("meta"):
            model = model_fn()
    except Exception:  # noqa: BLE001 - a model that needs real tensors: its ranks check it
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def compare(source: dict[str, tuple], model: dict[str, tuple], strict: bool, uri: str
            ) -> tuple[list[str], list[str]]:
    """(missing, unexpected) names: the model's that the source lacks, the source's that the
    model lacks. Raises PretrainedError on a shape that differs, and, when `strict`, on either."""
    missing = sorted(set(model) - set(source))
    unexpected = sorted(set(source) - set(model))
    shapes = [f"{k}: {source[k]} in the file, {model[k]} in the model"
              for k in sorted(set(model) & set(source)) if tuple(source[k]) != tuple(model[k])]
    if shapes:
        raise PretrainedError(f"train.init_from: {uri} holds tensors of other shapes than the "
                              f"model's: {_names(shapes)}")
    if strict and (missing or unexpected):
        parts = ([f"missing from the file: {_names(missing)}"] if missing else []) + \
                ([f"not in the model: {_names(unexpected)}"] if unexpected else [])
        raise PretrainedError(f"train.init_from: {uri} does not match the model's names "
                              f"({'; '.join(parts)}); set train.init_strict: false to load what "
                              f"matches (the rest keeps its init)")
    return missing, unexpected


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def prepare(job, model_fn, storage: Storage):
    """On the driver, for a job with train.init_from: the job with the source resolved (an
    absolute URI; a run folder's newest committed step), its names and shapes checked against
    the model; unchanged where the run resumes (it restores its own checkpoint and reads no
    init_from). Missing and unexpected names that train.init_strict: false lets through are
    logged by name."""
    tr = job.train
    if tr.init_from is None:
        return job
    if latest_committed(storage, checkpoints_root(storage.uri, job.run.name)) is not None:
        return job
    uri, missing, unexpected = check_source(tr.init_from, tr.init_strict, model_fn,
                                            storage.options)
    if missing or unexpected:
        log.warning("train.init_from: %s: %s keep their init (missing from the file); %s are not "
                    "loaded (not in the model)", uri, _names(missing) or "none",
                    _names(unexpected) or "none")
    return job.model_copy(update={"train": tr.model_copy(update={"init_from": uri})})


def check_source(init_from: str, strict: bool, model_fn, storage_options: dict
                 ) -> tuple[str, list, list]:
    """On the driver: the source resolved, readable, and its names and shapes against the model
    built on the meta device. Returns (resolved uri, missing, unexpected)."""
    uri = resolve(init_from, storage_options)
    try:
        source = source_shapes(uri, storage_options)
    except ConfigError:  # ours, or a missing extra's: said as it is
        raise
    except Exception as e:  # noqa: BLE001 - unreadable, not there, no state dict: the user's to fix
        raise PretrainedError(f"train.init_from: cannot read {uri}: {type(e).__name__}: {e}"
                              ) from None
    if not source:
        raise PretrainedError(f"train.init_from: {uri} holds no tensors")
    shapes = model_shapes(model_fn)
    if shapes is None:
        return uri, [], []
    missing, unexpected = compare(source, shapes, strict, uri)
    return uri, missing, unexpected


# ---------------------------------------------------------------- reading into a rank's tensors
def load_into(model_state: dict, uri: str, storage_options: dict, strict: bool, process_group,
              full_names: dict[str, tuple] | None) -> tuple[list[str], list[str]]:
    """Fill `model_state` (this rank's state dict of the model: plain tensors, or DTensors whose
    local part is this rank's) in place from `uri`. `full_names`: the whole model's names and
    shapes (a pipeline rank holds a stage's), for the unexpected names. Collective for a DCP
    source (every rank of `process_group` calls it). Returns (missing, unexpected)."""
    uri = resolve(uri, storage_options)  # the driver's already was (a step folder, or a file)
    source = source_shapes(uri, storage_options)
    mine = {k: tuple(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    missing, unexpected = compare(source, {**(full_names or mine), **mine}, strict, uri)
    wanted = {k: v for k, v in model_state.items() if k in source and isinstance(v, torch.Tensor)}
    if kind_of(uri) == "dcp":
        from elastic.checkpoint.loading import load_shards
        manifest = manifest_of(_fs_read(uri, MANIFEST, storage_options), uri)
        load_shards({"model": wanted}, uri, storage_options, process_group, manifest=manifest)
        return missing, unexpected
    with opened(uri, storage_options) as src, torch.no_grad():
        for name, target in wanted.items():
            local, offsets = local_part(target)
            if local.numel():
                local.copy_(src.read(name, offsets, tuple(local.shape)))
    return missing, unexpected


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of `t` and where it starts in the whole tensor."""
    if not hasattr(t, "placements"):
        return t, (0,) * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    assert tuple(local.shape) == tuple(shape), (tuple(local.shape), shape)
    return local, tuple(offsets)


def _fs_read(folder: str, name: str, storage_options: dict) -> bytes:
    fs, path = fsspec.core.url_to_fs(folder, **storage_options)
    return fs.cat_file(f"{path.rstrip('/')}/{name}")


def _dcp_reader(folder: str, storage_options: dict):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    return FsspecReader(folder, **storage_options)


class _File:
    """A safetensors or torch file opened for slices: `shapes()`, `read(name, offsets, shape)`."""

    def __init__(self, path: str, kind: str):
        self.kind = kind
        if kind == "safetensors":
            self._f = _safe_open(path)
            self._names = list(self._f.keys())
        else:
            # One pickle: it cannot be read in parts, but mapped, only the pages a rank's slices
            # touch are read (and they stay the page cache's, not the rank's own memory).
            sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            self._sd = _state_dict_in(sd, path)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self.kind == "safetensors":
            return {k: tuple(self._f.get_slice(k).get_shape()) for k in self._names}
        return {k: tuple(v.shape) for k, v in self._sd.items()}

    def read(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        index = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
        if self.kind == "safetensors":
            return self._f.get_slice(name)[index] if index else self._f.get_tensor(name)
        return self._sd[name][index]


def _state_dict_in(obj, path: str) -> dict[str, torch.Tensor]:
    """The tensors of a torch file: a state dict, or one under "state_dict" or "model"."""
    if isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict):
        raise PretrainedError(f"train.init_from: {path} holds a {type(obj).__name__}, not a "
                              f"state dict")
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def safetensors_module():
    """The safetensors package, or MissingExtra naming the extra that installs it."""
    try:
        import safetensors
    except ImportError as e:  # an optional extra: the core install trains without it
        from elastic.observability.timeline import MissingExtra
        raise MissingExtra("train.init_from: reading a .safetensors file needs the safetensors "
                           "package: pip install 'elastic-trainer[safetensors]'") from e
    return safetensors


def _safe_open(path: str):
    return safetensors_module().safe_open(path, framework="pt")


@contextmanager
def opened(uri: str, storage_options: dict) -> Iterator[_File]:
    """The file at `uri`, local (a remote one copied to a temporary file, removed after)."""
    fs, path = fsspec.core.url_to_fs(uri, **storage_options)
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        yield _File(path, kind_of(uri))
        return
    fd, local = tempfile.mkstemp(suffix=os.path.basename(path))
    os.close(fd)
    try:
        fs.get_file(path, local)
        yield _File(local, kind_of(uri))
    finally:
        os.unlink(local)
