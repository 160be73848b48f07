"""Helpers of the init_from and export tests: a GPT whose embedding is frozen, and each tensor's
whole value hashed, from a rank's model (any layout) or from a file."""
from __future__ import annotations

import hashlib

import torch
from torch import nn


def build_frozen_gpt() -> nn.Module:
    """examples/gpt.py's model with its embedding and first block frozen (requires_grad=False), as
    a fine-tune of a pretrained backbone freezes it (the block's Linears are split under tensor
    parallelism, the embedding is not)."""
    from examples.gpt import build_model
    model = build_model()
    for p in [*model[0].parameters(), *model[1].parameters()]:
        p.requires_grad_(False)
    return model


def tensor_hash(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(data).hexdigest()


def weight_hashes(model: nn.Module) -> dict[str, str]:
    """{name: sha256 of the whole tensor} over the rank's model state dict (a sharded or tp-split
    tensor gathered whole first: collective, every rank of its mesh calls it in the same order)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from elastic.parallel.tensor import as_dtensors
    held = as_dtensors(model, {"model": get_model_state_dict(model), "optim": {"state": {}}})
    held = held["model"]
    out = {}
    for name in sorted(held):
        t = held[name]
        out[name] = tensor_hash(t.full_tensor() if hasattr(t, "full_tensor") else t)
    return out


def state_probe(model: nn.Module) -> dict:
    """What a rank ends with (tests/spawn_ranks.py's probe): each tensor's hash and, per
    parameter, whether it trains (requires_grad)."""
    trains = {n: p.requires_grad for n, p in model.named_parameters()}
    return {"hashes": weight_hashes(model), "trains": trains}


def file_hashes(path: str) -> dict[str, str]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        sd = load_file(path)
    else:
        sd = torch.load(path, weights_only=True)
    return {k: tensor_hash(v) for k, v in sd.items()}


FILE_ENV = "ELASTIC_PROBE_FILE"  # the file `parts_match_file` compares with


def parts_match_file(model: nn.Module) -> bool:
    """Whether each tensor part this rank holds equals the same part of the file at
    $ELASTIC_PROBE_FILE, read slice by slice (no tensor gathered whole: no more memory than a
    slice)."""
    import os

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from elastic.checkpoint import pretrained
    from elastic.parallel.tensor import as_dtensors
    path = os.environ[FILE_ENV]
    held = as_dtensors(model, {"model": get_model_state_dict(model), "optim": {"state": {}}})
    held = held["model"]
    with pretrained.opened(path, {}) as src:
        for name, t in held.items():
            local, offsets = pretrained.local_part(t)
            if not torch.equal(local, src.read(name, offsets, tuple(local.shape))):
                return False
    return bool(held)
