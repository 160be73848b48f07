"""train.deterministic: the cuBLAS environment a rank sets, by device and by what is set already."""
from __future__ import annotations

import pytest

from elastic.config import parse_job
from elastic.runtime.determinism import CUBLAS_VAR, cublas_env


@pytest.mark.parametrize("device,env,want", [
    ("cuda", {}, {CUBLAS_VAR: ":4096:8"}),
    ("cuda", {CUBLAS_VAR: ":16:8"}, {}),  # the user's deterministic choice (less memory) is kept
    ("cuda", {CUBLAS_VAR: ":4096:8"}, {}),
    ("cuda", {CUBLAS_VAR: ":0:0"}, {CUBLAS_VAR: ":4096:8"}),  # not deterministic: torch would refuse
    ("cpu", {}, {}),
])
def test_cublas_workspace_is_set_on_gpu_unless_already_deterministic(device, env, want):
    assert cublas_env(device, env) == want


def test_deterministic_is_off_by_default():
    base = {"train": {"model": "m:f", "dataset": "m:f", "loss": "m:f", "global_batch_size": 8}}
    assert parse_job(base).train.deterministic is False
    assert parse_job({"train": {**base["train"], "deterministic": True}}).train.deterministic is True


def test_make_deterministic_on_gpu_sets_the_workspace_before_cuda_and_torchs_flags(monkeypatch):
    import os

    import torch

    from elastic.runtime.determinism import make_deterministic

    monkeypatch.setenv(CUBLAS_VAR, ":0:0")
    try:
        make_deterministic(torch.device("cuda", 0))  # no CUDA call: this machine needs no GPU
        assert os.environ[CUBLAS_VAR] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
