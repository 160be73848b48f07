"""A small GPT-style character model, written to be cut into pipeline stages.

The model is an `nn.Sequential` of units that each take the previous one's
output: token + position embedding, `N_LAYER` pre-norm transformer blocks
(causal self-attention and an MLP), and a head (final norm, projection to the
vocabulary). `train.strategy: pipeline` cuts it between units; the same
model trains under ddp and fsdp, and checkpoints move between all three.

Data: the character corpus of `examples.charlm` (Python's own sources), as
windows of CONTEXT characters whose targets are the same window shifted by one.
Sizes can be changed through environment variables (GPT_LAYERS, GPT_DIM,
GPT_CONTEXT) so that benchmarks can use a larger model; every worker sees the
same environment through Ray's runtime env.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from examples.charlm import VOCAB, NextCharDataset

N_LAYER = int(os.environ.get("GPT_LAYERS", "4"))
DIM = int(os.environ.get("GPT_DIM", "64"))
CONTEXT = int(os.environ.get("GPT_CONTEXT", "32"))
HEADS = 4


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(CONTEXT, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


class Block(nn.Module):
    """Pre-norm attention and MLP. The fused `qkv` projection is head-major (head h's q, k and v
    features one after another) and the forward takes the number of heads from the width it
    gets, so a column-wise split over tensor-parallel ranks gives each whole heads
    (train.tp: the built-in plan, elastic/parallel/tensor.py)."""

    heads = HEADS

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))  # (b, t, 3 x local width): this rank's heads
        b, t = qkv.shape[:2]  # the whole sequence: with sequence parallelism, x holds a part of it
        q, k, v = qkv.view(b, t, -1, 3, DIM // HEADS).permute(3, 0, 2, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def build_model() -> nn.Sequential:
    return nn.Sequential(Embed(), *[Block() for _ in range(N_LAYER)], Head())


def build_dataset() -> NextCharDataset:
    return NextCharDataset(stride=11, context=CONTEXT, shifted=True)


def stage_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The pipeline's loss (train.pipeline.loss): the last stage's output against the targets."""
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    """The same loss for ddp and fsdp (train.loss)."""
    x, y = batch
    return stage_loss(model(x), y)


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
