"""GPU drills at world size 1 on NCCL: each layout trained once uninterrupted and once with its
worker's process killed mid-run (restored from storage: no survivor at world size 1); the two
runs' final state digests must match. Prints one JSON line per drill.

python -m benchmarks.probes.gpu_drills [--cpu] [DRILL ...]  (--cpu: the same on gloo, to check the script here)"""
from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

import yaml

from elastic import Trainer
from elastic.local_cluster import local_cluster

ROOT = Path(__file__).resolve().parents[2]

STEPS, EVERY, FAULT = 20, 5, 12

DRILLS = {
    "fsdp+offload+ac bf16": dict(strategy="fsdp", fsdp={"offload": True}, activation_checkpointing=["Block"],
                                 precision="bf16"),
    "fsdp+meta_init+ac bf16": dict(strategy="fsdp", meta_init=True, activation_checkpointing=["Block"],
                                   precision="bf16"),
    "fsdp fp16": dict(strategy="fsdp", precision="fp16"),
}


def job(work: str, gpu: bool, train: dict, chaos=()) -> dict:
    j = yaml.safe_load((ROOT / "examples" / "gpt_3d.yaml").read_text())
    j["run"].update(name=f"gpu-{uuid.uuid4().hex[:8]}", num_steps=STEPS)
    j["scaling"] = {"num_workers": 1, "cpus_per_worker": 1, "use_gpu": gpu}
    j["checkpoint"].update(storage_uri="file://" + work, every_steps=EVERY)
    j["failure"]["hang_floor_s"] = 20
    j["train"].pop("pipeline")
    j["train"].pop("tp")
    j["train"].pop("meta_init")
    j["train"].pop("activation_checkpointing")
    j["train"]["loss"] = "examples.gpt:loss_fn"
    j["train"].update(train)
    j["chaos"] = [dict(c) for c in chaos]
    return j


def main() -> int:
    cpu = "--cpu" in sys.argv
    gpus = 0
    if not cpu:
        import torch
        gpus = torch.cuda.device_count()
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    work = tempfile.mkdtemp(prefix="gpu-drill-")
    ok = True
    with local_cluster(num_worker_nodes=1, cpus_per_node=2, gpus_per_node=gpus, dashboard=False):
        for name, train in DRILLS.items():
            if only and name not in only:
                continue
            rec = {"drill": name, "backend": "gloo" if cpu else "nccl"}
            try:
                t0 = time.time()
                base = Trainer(job(work, not cpu, train)).fit(progress=False)
                rec["base_s"] = round(time.time() - t0, 1)
                t0 = time.time()
                hit = Trainer(job(work, not cpu, train, [{"action": "kill_process", "rank": 0,
                                                           "at_step": FAULT}])).fit(progress=False)
                rec["fault_s"] = round(time.time() - t0, 1)
                rec["steps"] = [base.metrics.get("step"), hit.metrics.get("step")]
                rec["loss"] = [base.metrics.get("loss"), hit.metrics.get("loss")]
                rec["errors"] = [base.error, hit.error]
                rec["restored"] = [e.get("source") for e in hit.events_of("restored")]
                rec["recovered"] = [{k: e.get(k) for k in ("recover_s", "lost_steps", "path")}
                                    for e in hit.events_of("recovered")]
                rec["identical"] = bool(base.digests) and base.digests == hit.digests
                ok &= rec["identical"] and rec["steps"] == [STEPS, STEPS]
            except Exception:  # one drill's failure must not hide the others'
                rec["exception"] = traceback.format_exc()[-2000:]
                ok = False
            print(json.dumps(rec), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
