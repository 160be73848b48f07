"""Deterministic kernels on a rank (train.deterministic).

Seeding makes a step draw the same random numbers (elastic/runtime/step.py); it does not make
kernels add in the same order. On GPU, cuBLAS splits reductions over a workspace whose layout
varies unless CUBLAS_WORKSPACE_CONFIG fixes it (torch's deterministic mode refuses a cuBLAS call
without it), and cuDNN picks algorithms by timing them. The rank sets both before CUDA starts.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

log = logging.getLogger(__name__)

CUBLAS_VAR = "CUBLAS_WORKSPACE_CONFIG"
# The two settings cuBLAS documents as deterministic; torch accepts either.
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def cublas_env(device_type: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a rank on `device_type` needs for deterministic cuBLAS: empty where it has
    it already (a user's :16:8, which uses less memory, is kept) and on CPU."""
    if device_type != "cuda" or environ.get(CUBLAS_VAR) in CUBLAS_DETERMINISTIC:
        return {}
    return {CUBLAS_VAR: CUBLAS_DETERMINISTIC[0]}


def make_deterministic(device: torch.device) -> None:
    """Deterministic algorithms in this process, from now on. Call before CUDA starts: cuBLAS reads
    its workspace setting when it creates its handle."""
    env = cublas_env(device.type, os.environ)
    if CUBLAS_VAR in env and os.environ.get(CUBLAS_VAR):
        log.warning("train.deterministic: %s=%s is not deterministic; set to %s", CUBLAS_VAR,
                    os.environ[CUBLAS_VAR], env[CUBLAS_VAR])
    os.environ.update(env)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
