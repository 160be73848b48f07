"""A small character-level language model trained on real text that ships with
Python itself: the source of a few standard-library modules.

Each sample is a window of CONTEXT characters and the character that follows;
the model embeds the window, and an MLP predicts the next character. Small
enough to train on a laptop's CPU, real enough that the loss means something
(it falls from ln(128) = 4.85 towards ~2 within a few hundred steps).
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

CONTEXT = 32
VOCAB = 128  # ASCII; anything else maps to 0
EMBED = 24
HIDDEN = 512
MODULES = ("json.decoder", "json.encoder", "textwrap", "argparse", "dataclasses")


def corpus() -> torch.Tensor:
    import importlib
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    return torch.tensor([c if c < VOCAB else 0 for c in text.encode("ascii", "replace")], dtype=torch.long)


class NextCharDataset(torch.utils.data.Dataset):
    """Windows of `context` characters, every `stride`; the target is the next character, or
    (`shifted`) the whole window shifted by one, as a GPT-style model predicts every position."""

    def __init__(self, stride: int = 7, context: int = CONTEXT, shifted: bool = False):
        self.data = corpus()
        self.context, self.shifted = context, shifted
        self.starts = torch.arange(0, len(self.data) - context - 1, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        s, n = int(self.starts[i]), self.context
        return self.data[s:s + n], (self.data[s + 1:s + n + 1] if self.shifted else self.data[s + n])


def build_dataset() -> NextCharDataset:
    return NextCharDataset()


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(VOCAB, EMBED), nn.Flatten(),
        nn.Linear(CONTEXT * EMBED, HIDDEN), nn.GELU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
        nn.Linear(HIDDEN, VOCAB),
    )


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01)
