"""Where one recovery's time goes, step by step: the recovery benchmark's elastic job (FSDP with
a copy every step, `checkpoint.memory_sync`; SYSTEM as in `benchmarks recovery`, elastic-spare:
with a warm spare; rank 1's node killed after step 25) run once on a local cluster, then the recovery's events and every rank's step records around the
fault (from the run's steps.json: when each step ended, its time, its compute), in seconds from
the fault.

    flock /tmp/elastic-ray.lock python -m benchmarks.probes.recovery_steps [SIZE] [SYSTEM]
    (default 90M elastic-spare; SIZE as `benchmarks recovery --params`)
"""
from __future__ import annotations

import json
import sys

EVENTS = ("failure_detected", "workers_replaced", "group_formed", "restored", "recovered")


def main(size: str = "90M", system: str = "elastic-spare") -> None:
    from benchmarks.output import scratch_dir
    from benchmarks.overhead import connect_with_env
    from benchmarks.recovery import NUM_WORKERS, model_size, parse_params, run_elastic
    from elastic.local_cluster import local_cluster
    from elastic.observability.timeline import load
    from elastic.observability.trace import load_steps
    from elastic.workload import HIDDEN_ENV

    hidden, _ = model_size(parse_params(size)[0])
    with local_cluster(num_worker_nodes=NUM_WORKERS + 1, cpus_per_node=1) as cluster:
        if hidden:
            connect_with_env(cluster, {HIDDEN_ENV: str(hidden)})
        rec = run_elastic(system, "file://" + scratch_dir("elastic-probe-") + "/runs", {}, "kill_node", 25,
                          strategy="fsdp", copy_sync=True)
    print(f"recover_s {rec['recover_s']:.2f}", {k: v for k, v in rec.items() if k.startswith("t_")})
    events = load(rec["run_dir"])  # the run's own log and step records: run_elastic returns figures
    fault = next(e["t"] for e in events if e["kind"] == "fault_injected")
    for e in events:
        if e["kind"] in EVENTS and fault <= e["t"] <= fault + 60:
            rest = {k: v for k, v in e.items() if k not in ("t", "kind")}
            print(f"  {e['t'] - fault:+.2f} {e['kind']} {json.dumps(rest)[:200]}")
    steps = load_steps(rec["run_dir"])
    for rank, rows in sorted(steps["ranks"].items()):
        for step, t_end, step_s, compute_s in rows:
            if 20 <= step <= 30:
                print(f"rank {rank} step {step} ended {t_end - fault:+.2f} s, took {step_s:.2f} s, "
                      f"compute {compute_s:.2f} s")


if __name__ == "__main__":
    main(*sys.argv[1:3])
