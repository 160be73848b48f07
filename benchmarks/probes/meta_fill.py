"""What a restore saves by not initialising a meta-built model it is about to overwrite: examples/gpt.py
built on the meta device and materialised on the CPU with `fill=True` (every module initialised from
the seed, as a fresh start does) and `fill=False` (allocated and set to NaN, as every restore path
does since the state comes from storage, a peer or copies next), one thread, alternating.

    GPT_LAYERS=8 GPT_DIM=1024 GPT_CONTEXT=64 python -m benchmarks.probes.meta_fill [REPS]
"""
from __future__ import annotations

import copy
import statistics
import sys
import time

import torch


def main(reps: int = 3) -> None:
    from elastic.parallel import meta_init
    from examples.gpt import build_model
    torch.set_num_threads(1)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(reps):
        for fill in (True, False):
            with torch.device("meta"):
                model = build_model()
            template = copy.deepcopy(model)
            t0 = time.perf_counter()
            meta_init.materialize(model, template, torch.device("cpu"), 0, None, fill)
            times[fill].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f} M parameters, {reps} reps: materialize with fill {statistics.median(times[True]):.2f} s, "
          f"without {statistics.median(times[False]):.2f} s (medians; each: {times})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
