"""A checkpoint's upload in the worker's process or in a child process
(elastic/checkpoint/uploader.py), with the benchmark's MLP training on one thread of the same
process, as a rank's persist runs beside its training.

One process, world size 1 on gloo, a SeaweedFS S3 endpoint on loopback, the same 120 MB as
`python -m benchmarks checkpoint` at 10.3 M parameters (2 model and 4 Adam tensors of 5 M floats).
Each round runs `checkpoint.save_shards` (DCP staging on local disk, then the upload) once per
setting, in shuffled order, 2 s apart; per save: its seconds, and the training steps per second
while it ran. Prints every round's figures, the medians, and in how many rounds each side won.
Usage: python benchmarks/probes/upload_process_probe.py [ROUNDS] [SEED]   (default 20 rounds, seed 5)"""
import os
import random
import statistics
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import elastic.checkpoint.dcp_io as C  # noqa: E402
from training_thread import train  # noqa: E402
from tests.support.seaweedfs import seaweedfs_server  # noqa: E402

N = 5_000_000


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    random.seed(int(sys.argv[2]) if len(sys.argv) > 2 else 5)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29545"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    pg = dist.new_group(backend="gloo")
    state = {"model": {f"w{i}": torch.randn(N) for i in range(2)}, "opt": {f"m{i}": torch.randn(N) for i in range(4)}}
    seconds: dict[str, list[float]] = {"child": [], "worker": []}
    rate: dict[str, list[float]] = {"child": [], "worker": []}
    with seaweedfs_server() as s3:
        C.save_shards(state, f"{s3.uri}/first", s3.storage_options, pg)  # the child starts here, untimed
        assert C.uploader.ready(60), "the uploader's child did not start"
        stop, steps = threading.Event(), [0]
        trainer = threading.Thread(target=train, args=(stop, steps), daemon=True)
        trainer.start()
        time.sleep(2)
        for i in range(rounds):
            order = ["child", "worker"]
            random.shuffle(order)
            for where in order:
                C.UPLOAD_IN_CHILD = where == "child"
                time.sleep(2)
                s0, t0 = steps[0], time.perf_counter()
                C.save_shards(state, f"{s3.uri}/r{i}-{where}", s3.storage_options, pg)
                dt = time.perf_counter() - t0
                seconds[where].append(dt)
                rate[where].append((steps[0] - s0) / dt)
            print(f"round {i}: " + ", ".join(f"{w} {seconds[w][-1]:.2f} s at {rate[w][-1]:.2f} steps/s"
                                             for w in ("child", "worker")), flush=True)
        stop.set()
    for w in ("child", "worker"):
        print(f"upload in the {w}: save median {statistics.median(seconds[w]):.3f} s, training during it "
              f"median {statistics.median(rate[w]):.2f} steps/s")
    faster = sum(c < w for c, w in zip(seconds["child"], seconds["worker"]))
    more = sum(c > w for c, w in zip(rate["child"], rate["worker"]))
    print(f"of {rounds} rounds: the save was faster with the child in {faster}, training faster in {more}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
