"""HSDP x TP node-kill drill on a local cluster (head + 5 one-CPU nodes): examples/hsdp_tp.yaml,
shortened, run once uninterrupted and once with the node of rank 5 killed after step FAULT, with
a warm spare. Prints the restore plan, the recovery and whether both runs end bit-identical.
    flock /tmp/elastic-ray.lock python -m benchmarks.probes.hsdp_tp_drill OUT_DIR"""
from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import yaml

from elastic import Trainer
from elastic.local_cluster import local_cluster

NUM_STEPS, EVERY, FAULT = 14, 5, 9


def job(out: Path, chaos=(), spares=0) -> dict:
    j = yaml.safe_load((Path(__file__).parents[2] / "examples" / "hsdp_tp.yaml").read_text())
    j["run"].update(name=f"hsdp-tp-{uuid.uuid4().hex[:6]}", num_steps=NUM_STEPS, sample_ledger=True)
    j["checkpoint"].update(storage_uri=str(out / "runs"), every_steps=EVERY)
    j["scaling"].update(num_spares=spares, wait_for_spares=bool(spares), shrink_after_s=120)
    j["failure"]["hang_floor_s"] = 60  # 8 ranks share 2 cores here: a first step takes over 10 s
    j["chaos"] = [dict(c) for c in chaos]
    return j


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with local_cluster(num_worker_nodes=5, cpus_per_node=1, dashboard=False) as c:
        base = Trainer(job(out)).fit(progress=False)
        c.ensure_worker_nodes(5)
        j = job(out, [{"action": "kill_node", "rank": 5, "at_step": FAULT}], spares=1)
        run = Trainer(j).fit(progress=False)
    rec = {"identical": run.digests == base.digests, "digests": len(set(run.digests.values())),
           "restore_plan": run.events_of("restore_plan"), "restored": run.events_of("restored")[-1:],
           "recovered": run.events_of("recovered"), "replaced": run.events_of("workers_replaced"),
           "placement": run.events_of("placement")}
    (out / "hsdp_tp_drill.json").write_text(json.dumps(rec, indent=1, default=str))
    print(json.dumps(rec, indent=1, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
