"""The common benchmark workload (docs/benchmarks/recovery.md): an MLP of about 1.3 M
parameters on a fixed synthetic classification task. Same for every system
compared, so only the framework differs.

A benchmark that compares model sizes sets ELASTIC_BENCH_HIDDEN in the job's runtime
environment: every process of every system then builds the same, wider MLP."""
from __future__ import annotations

import os

import torch
from torch import nn

IN_FEATURES = 256
HIDDEN = 1024
NUM_CLASSES = 10
NUM_SAMPLES = 8192
HIDDEN_ENV = "ELASTIC_BENCH_HIDDEN"  # the MLP's hidden width, when a benchmark sets it


def hidden_width() -> int:
    return int(os.environ.get(HIDDEN_ENV) or HIDDEN)


def build_mlp(hidden: int, activation: type[nn.Module] = nn.ReLU) -> nn.Module:
    """256 -> hidden -> hidden -> 10: the hidden width sets the size."""
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden), activation(),
        nn.Linear(hidden, hidden), activation(),
        nn.Linear(hidden, NUM_CLASSES),
    )


def build_model() -> nn.Module:
    return build_mlp(hidden_width())


class TeacherDataset(torch.utils.data.Dataset):
    """Inputs from a fixed seed, labels from a fixed random teacher: learnable, deterministic."""

    def __init__(self, num_samples: int = NUM_SAMPLES, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, IN_FEATURES, generator=g)
        teacher = torch.randn(IN_FEATURES, NUM_CLASSES, generator=g)
        self.y = (self.x @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def build_dataset() -> TeacherDataset:
    return TeacherDataset()


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def build_sgd(params):
    """SGD with momentum: runs at different world sizes stay within float rounding of each other
    (AdamW's normalised update turns rounding differences in near-zero gradients into +-lr
    steps), so resize tests compare against an unresized run with a tight tolerance."""
    return torch.optim.SGD(params, lr=0.002, momentum=0.9)
