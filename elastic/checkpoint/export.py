"""The model out of a run: `elastic export RUN [--step N] --to model.safetensors|model.pt`.

A committed checkpoint (the newest, or step N) is read whole, in this one process with no process
group: DCP assembles each tensor from the shards every rank wrote, whatever the layout was (FSDP
shards, tensor-parallel slices, pipeline stages, replicas), and the file written holds the model's
weights alone (no optimizer state), under the names the user's model gives them, as plain tensors
of the dtype they were saved in. `model.load_state_dict(torch.load("model.pt"))` or safetensors'
`load_file` reads it back with nothing of elastic installed. Every byte read is checked against
the checkpoint's manifest, as a restore checks it (elastic/checkpoint/loading.py). The other
direction is `train.init_from` (pretrained.py).
"""
from __future__ import annotations

import os
import tempfile

import fsspec
import torch

from elastic.checkpoint.layout import (COMMIT_MARKER, CommittedCheckpoint, committed_checkpoints,
                                       step_dir, validate)
from elastic.checkpoint.loading import load_shards
from elastic.checkpoint.pretrained import MODEL_PREFIX, TORCH_SUFFIXES
from elastic.config.loading import ConfigError
from elastic.storage import Storage, StorageError, join, normalize_uri


class ExportError(ConfigError):
    """The export cannot be made as asked; the message says why and what to give."""


def find_checkpoint(run: str, step: int | None, storage_options: dict) -> CommittedCheckpoint:
    """The committed checkpoint of `run` (a run folder, its checkpoints folder, or a step folder)
    at `step`, or its newest."""
    uri = normalize_uri(run)
    try:
        storage = Storage(uri, storage_options)
        if storage.exists(join(uri, COMMIT_MARKER)):  # a step folder
            found = [CommittedCheckpoint(uri, validate(storage, uri))]
            if step is None or found[0].step == step:
                return found[0]
            raise ExportError(f"{run} is the checkpoint of step {found[0].step}, not of --step "
                              f"{step}: give the run folder")
        root = join(uri, "checkpoints") if storage.exists(join(uri, "checkpoints")) else uri
        found = committed_checkpoints(storage, root)
    except StorageError as e:
        raise ExportError(f"cannot read {run}: {e}") from None
    except ValueError as e:
        raise ExportError(f"{run}: {e}") from None
    if not found:
        raise ExportError(f"{run} holds no committed checkpoint (give a run folder, its "
                          f"checkpoints folder or a committed step folder)")
    if step is None:
        return found[0]
    at = [c for c in found if c.step == step]
    if not at:
        raise ExportError(f"{run} has no committed checkpoint of step {step} "
                          f"({step_dir(root, step)}); committed: steps "
                          f"{sorted(c.step for c in found)}")
    return at[0]


def read_model(checkpoint: CommittedCheckpoint, storage_options: dict) -> dict[str, torch.Tensor]:
    """The model's whole tensors from `checkpoint`, by the model's names."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = FsspecReader(checkpoint.uri, **storage_options).read_metadata().state_dict_metadata
    model = {k[len(MODEL_PREFIX):]: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in meta.items()
             if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}
    if not model:
        raise ExportError(f"{checkpoint.uri} holds no model tensors (no 'model.' entries in "
                          f"its DCP index)")
    # No process group: DCP plans and reads in this process alone, every shard of every rank.
    load_shards({"model": model}, checkpoint.uri, storage_options, None,
                manifest=checkpoint.manifest)
    return model


def file_kind(to: str) -> str:
    """"safetensors" or "torch", from the file's name; an unknown one, or safetensors without its
    package, is refused before anything is read."""
    if to.lower().endswith(".safetensors"):
        _safetensors_save()
        return "safetensors"
    if to.lower().endswith(TORCH_SUFFIXES):
        return "torch"
    raise ExportError(f"--to {to}: name a .safetensors or a .pt (.pth, .bin) file")


def write(model: dict[str, torch.Tensor], to: str, storage_options: dict) -> int:
    """`model` as a safetensors or torch file at `to` (a path or URI). Returns its bytes."""
    kind = file_kind(to)
    fs, path = fsspec.core.url_to_fs(normalize_uri(to), **storage_options)
    local_fs = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    if local_fs:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    # Written beside its place (or to a temporary file for a remote one), then moved: a reader
    # never sees half a model.
    fd, tmp = tempfile.mkstemp(suffix=os.path.basename(path),
                               dir=os.path.dirname(path) if local_fs else None)
    os.close(fd)
    try:
        if kind == "safetensors":
            _safetensors_save()({k: v.contiguous() for k, v in model.items()}, tmp,
                                metadata={"format": "pt"})
        else:
            torch.save(model, tmp)
        size = os.path.getsize(tmp)
        if local_fs:
            os.replace(tmp, path)
        else:
            fs.put_file(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return size


def _safetensors_save():
    try:
        from safetensors.torch import save_file
    except ImportError as e:  # an optional extra
        from elastic.observability.timeline import MissingExtra
        raise MissingExtra("writing a .safetensors file needs the safetensors package: pip install "
                           "'elastic-trainer[safetensors]' (or export --to model.pt)") from e
    return save_file


def export(run: str, to: str, step: int | None = None, storage_options: dict | None = None) -> dict:
    """Write `run`'s model (its newest committed checkpoint, or `step`'s) to `to`. Returns what
    was written: the checkpoint, its step, the tensors, parameters and bytes."""
    options = dict(storage_options or {})
    file_kind(to)
    checkpoint = find_checkpoint(run, step, options)
    model = read_model(checkpoint, options)
    size = write(model, to, options)
    return {"checkpoint": checkpoint.uri, "step": checkpoint.step, "tensors": len(model),
            "numel": sum(t.numel() for t in model.values()), "bytes": size, "to": to}
