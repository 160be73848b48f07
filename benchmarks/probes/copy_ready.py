"""What a DDP rank spends getting ready to receive a peer's copy of the state, besides the copy:
its build (eager, with the model's init, against on meta and allocated, `state.build(fill=False,
copied=True)`) and its optimizer's state made (zeros for AdamW's moments: the pages' first
touch, which a warm spare now pays while it waits, `state.ready_for_a_copy`). One Worker in this
process, joined to a world of one (gloo), one compute thread, the benchmarks' MLP at HIDDEN
width (default 9354: 90.0 M parameters). Alternating, ROUNDS of each after an untimed build.

    python -m benchmarks.probes.copy_ready [HIDDEN]
"""
from __future__ import annotations

import json
import statistics
import sys
import time

ROUNDS = 3


def main(hidden: int = 9354) -> dict:
    from benchmarks.probes.warm_build import bench_worker
    from elastic.checkpoint.fencing import write_fence
    from elastic.parallel.optim_state import prime_optimizer_state
    from elastic.runtime import state
    from elastic.storage import Storage
    from tests.spawn_ranks import rendezvous_port

    w, uri, root = bench_worker(hidden, "copy-ready", 1)
    write_fence(Storage(uri, {}), root, 1)  # the controller's part: before the group forms
    w.join("127.0.0.1", rendezvous_port(), 0, 1, generation=1)
    state.build(w, fill=False)
    times: dict[str, list[float]] = {"build_eager_s": [], "build_on_meta_s": [],
                                     "optimizer_state_s": []}
    for _ in range(ROUNDS):
        for copied in (False, True):
            t0 = time.perf_counter()
            state.build(w, fill=False, copied=copied)
            times["build_on_meta_s" if copied else "build_eager_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            prime_optimizer_state(w.optimizer)
            times["optimizer_state_s"].append(time.perf_counter() - t0)
    w.leave()
    return {"params": sum(p.numel() for p in w.model.parameters()),
            **{k: [round(x, 3) for x in v] for k, v in times.items()},
            **{f"median_{k}": round(statistics.median(v), 3) for k, v in times.items()}}


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:2]))))
