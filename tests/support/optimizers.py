"""torch's fused optimizers for the tests of the update decided on the device
(elastic/runtime/step.py), and the same kernels with the update decided on the host: hidden from
the step as optimizers that take `found_inf`, they make the step read its statistics before each
update, as any other optimizer does."""
from __future__ import annotations

import torch


def fused_adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def fused_sgd(params):
    return torch.optim.SGD(params, lr=0.002, momentum=0.9, fused=True)


def _host_decided(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    opt._step_supports_amp_scaling = False  # what GradScaler reads to hand an optimizer found_inf
    return opt


def fused_adamw_host_decided(params):
    return _host_decided(fused_adamw(params))


def fused_sgd_host_decided(params):
    return _host_decided(fused_sgd(params))
