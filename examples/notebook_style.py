"""Training as a notebook does it: the model, the data, the loss, the optimizer and the schedule
are defined right here, in `__main__`, and handed to `Trainer` as objects, not 'module:function'
strings. elastic sends them to the workers pickled by `ray.cloudpickle` (by value, since the
workers cannot import `__main__`), as Ray sends a remote function.

    python examples/notebook_style.py [STORAGE_URI]     # default file://./runs

Paste the cells into a notebook and they run the same. The run's config.yaml names each object
(`model: <object __main__.build_model>`).
"""
import functools
import sys

import torch
from torch import nn

from elastic import Trainer

WIDTH = 64


class TwoLayer(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build_model() -> nn.Module:
    return TwoLayer()


class Blobs(torch.utils.data.Dataset):
    """Four Gaussian clusters in 16 dimensions, from a fixed seed."""

    def __init__(self, num_samples: int = 1024):
        g = torch.Generator().manual_seed(7)
        self.y = torch.randint(0, 4, (num_samples,), generator=g)
        centres = torch.randn(4, 16, generator=g) * 3
        self.x = centres[self.y] + torch.randn(num_samples, 16, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main(storage_uri: str = "file://./runs", num_steps: int = 30):
    return Trainer({
        "run": {"name": "notebook-style", "num_steps": num_steps, "seed": 0},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_uri": storage_uri, "every_steps": 10},
        "train": {
            "model": build_model,                       # a function of __main__
            "dataset": Blobs(),                         # the dataset itself
            "loss": loss_fn,
            "optimizer": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
            "scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5),
            "global_batch_size": 64,
        },
    }).fit(progress=False)


if __name__ == "__main__":
    result = main(*sys.argv[1:2])
    print(f"loss {result.metrics['loss']:.4f} at step {result.metrics['step']}; "
          f"run folder {result.run_dir}")
