"""The benchmark's MLP training on a thread of the probe's own process, as a rank's training runs
beside its persist: the load of persist_probe.py and upload_process_probe.py."""
import threading

import torch

from elastic.workload import build_mlp


def train(stop: threading.Event, steps: list[int], hidden: int = 3072) -> None:
    """AdamW steps on one fixed batch of 96 until `stop` is set; `steps[0]` counts them."""
    model = build_mlp(hidden)
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(96, 256), torch.randint(0, 10, (96,))
    while not stop.is_set():
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps[0] += 1
