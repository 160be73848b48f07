"""`train.init_from` under `train.meta_init` at >= 400 M fp32 parameters, FSDP over 4 real Workers
on gloo ranks spawned without Ray: what each rank's build and load hold at their peak.

examples/gpt.py at GPT_DIM=2048 GPT_LAYERS=8 (402.7 M parameters, 1,536 MiB of fp32 weights) is
built once, eagerly, and saved as a safetensors file (kept in --cache). Then each rank joins its
group and, with a thread sampling its anonymous resident memory (RssAnon: its own memory, not the
page cache of the file it maps) every 5 ms, restores as a fresh start does: builds on the meta
device, allocates and initialises its FSDP shard module by module, and reads its slices of the
file over it. Reported per rank: RssAnon before the restore (the baseline: interpreter, torch,
the dataset, the group), its peak during it, and VmHWM (peak RSS, the mapped file's pages
included); then whether each rank's part equals the file's. The same run without init_from is
measured alongside, for what the load adds. The bound the issue sets: peak - baseline <= a quarter
of the weights + the largest module at full size (the meta init's one-module copy).

    python -m benchmarks.probes.init_from_memory [--cache /tmp/elastic-init-from] [--world 4]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import tempfile
import threading

BIG = {"GPT_DIM": "2048", "GPT_LAYERS": "8", "GPT_CONTEXT": "32"}
MIB = 2 ** 20


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rank_main(rank: int, world: int, port: int, job_json: str, root: str, path: str | None, q) -> None:
    os.environ.update(BIG)
    from elastic.runtime.actor import import_worker
    Worker = import_worker()
    w = Worker(job_json, root)
    w.join("127.0.0.1", port, rank, world, generation=1, pp=1)
    base = _status("RssAnon")
    peak, stop = [base], threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], _status("RssAnon"))
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    w.restore([])
    stop.set()
    t.join()
    peak[0] = max(peak[0], _status("RssAnon"))
    same = None
    if path is not None:
        from tests.support.pretrained import FILE_ENV, parts_match_file
        os.environ[FILE_ENV] = path
        same = parts_match_file(w.model)
    q.put((rank, round(base), round(peak[0]), round(_status("VmHWM")), same))
    w.leave()


def _job(root: str, name: str, world: int, **train) -> dict:
    return {"run": {"name": name, "num_steps": 1, "seed": 0}, "scaling": {"num_workers": world},
            "checkpoint": {"storage_uri": f"file://{root}", "every_steps": 100},
            "train": {"model": "examples.gpt:build_model", "dataset": "examples.gpt:build_dataset",
                      "loss": "examples.gpt:loss_fn", "global_batch_size": 16, "strategy": "fsdp",
                      "meta_init": True, **train}}


def _model_sizes() -> tuple[int, int]:
    """(parameters, bytes of the largest module's own tensors) of the big model, on meta."""
    import torch
    from examples import gpt
    with torch.device("meta"):
        model = gpt.build_model()
    own = [sum(t.numel() * t.element_size() for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)
           for m in model.modules()]
    return sum(p.numel() for p in model.parameters()), max(own)


def _run(job: dict, world: int, root: str, path: str | None) -> list[tuple]:
    from elastic.checkpoint.fencing import write_fence
    from elastic.checkpoint.layout import checkpoints_root
    from elastic.config import JobConfig
    from elastic.storage import Storage
    from tests.spawn_ranks import rendezvous_port
    jc = JobConfig.model_validate(job)
    ckpt_root = checkpoints_root(jc.checkpoint.storage_uri, jc.run.name)
    write_fence(Storage(jc.checkpoint.storage_uri), ckpt_root, 1)
    port = rendezvous_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, jc.model_dump_json(), ckpt_root, path, q))
             for r in range(world)]
    for p in procs:
        p.start()
    out = sorted((q.get(timeout=1800) for _ in procs), key=lambda o: o[0])
    for p in procs:
        p.join(timeout=60)
    return out


def main() -> None:
    os.environ.update(BIG)  # before examples.gpt is imported: its sizes are read at import
    import torch
    from safetensors.torch import save_file
    p = argparse.ArgumentParser()
    p.add_argument("--cache", default="/tmp/elastic-init-from")
    p.add_argument("--world", type=int, default=4)
    args = p.parse_args()
    cache = pathlib.Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / "gpt-2048x8.safetensors"
    if not path.exists():
        from examples import gpt
        torch.manual_seed(123)
        save_file({k: v.contiguous() for k, v in gpt.build_model().state_dict().items()}, str(path))
    params, module_bytes = _model_sizes()
    root = tempfile.mkdtemp()
    loaded = _run(_job(root, "loaded", args.world, init_from=str(path)), args.world, root, str(path))
    plain = _run(_job(root, "plain", args.world), args.world, root, None)
    bound = (4 * params / args.world + module_bytes) / MIB
    print(json.dumps({
        "parameters": params, "weights_mib": round(4 * params / MIB), "world": args.world,
        "largest_module_mib": round(module_bytes / MIB), "bound_above_baseline_mib": round(bound),
        "init_from": [{"rank": r, "baseline_mib": b, "peak_mib": pk, "above_baseline_mib": pk - b,
                       "vmhwm_mib": hwm, "parts_equal_the_file": same} for r, b, pk, hwm, same in loaded],
        "without_init_from": [{"rank": r, "baseline_mib": b, "peak_mib": pk, "above_baseline_mib": pk - b,
                               "vmhwm_mib": hwm} for r, b, pk, hwm, _ in plain],
        "within_bound": all(pk - b <= bound for _, b, pk, _, _ in loaded),
    }, indent=1))


if __name__ == "__main__":
    main()
