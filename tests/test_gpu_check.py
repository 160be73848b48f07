"""benchmarks/gpu_check.sh without a GPU: its arguments, and the optimizer knob it sets for the
overhead benchmark. Its --cpu run starts Ray clusters and takes minutes: run by hand (see
docs/benchmarks/gpu.md)."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


def test_the_script_says_what_it_runs_and_refuses_what_it_does_not_know():
    usage = subprocess.run([SCRIPT, "--help"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 0 and "set_sync_debug_mode" in usage.stdout and "--cpu" in usage.stdout
    wrong = subprocess.run([SCRIPT, "--gpus", "2"], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "unknown argument '--gpus'" in wrong.stderr
    no_dir = subprocess.run([SCRIPT, "--out"], capture_output=True, text=True, timeout=30)
    assert no_dir.returncode == 2 and "--out needs a folder" in no_dir.stderr


def test_the_overhead_benchmark_trains_every_system_with_the_optimizer_named(monkeypatch):
    from benchmarks.overhead import OPTIMIZER_ENV, timed_optimizer
    params = [torch.nn.Parameter(torch.zeros(2))]
    monkeypatch.delenv(OPTIMIZER_ENV, raising=False)
    assert not timed_optimizer(params).defaults["fused"]  # the common workload's AdamW
    monkeypatch.setenv(OPTIMIZER_ENV, "adamw-fused")
    opt = timed_optimizer(params)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"]
    monkeypatch.setenv(OPTIMIZER_ENV, "sgd")
    with pytest.raises(ValueError, match="ELASTIC_BENCH_OPTIMIZER='sgd': give adamw or adamw-fused"):
        timed_optimizer(params)
