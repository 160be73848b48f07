"""What a refill spare's start costs training, with and without `scaling.low_priority_refills`:
`python -m benchmarks.refill_priority PAIRS OUT.jsonl` (about 75 s per run here).

The run is `python -m benchmarks straggler`'s mitigated one (3 ranks + 1 spare, rank 1 3x slower from
step 10, swapped for the spare), whose refill spare starts on the freed node while the new group
trains; the two settings alternate, in swapped order every other pair, on one local cluster. Per
run, from global rank 0's optimizer step clock (`timed_optimizer`):

* steady_s: the median step over steps 150..300 (the refill is long ready);
* window_ratio: the median step over the swapped group's steps up to step 60 (the refill is
  starting) divided by steady_s;
* refill_cost_s: the sum over the swapped group's steps up to step 120 of (step - steady_s); it
  also holds the new group's first steps and two checkpoints, the same in both settings;
* spare_ready_after_s: the refill's `spare_ready` after the swapped group's restore.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys


def figures(times: list[float], restored_step: int) -> dict:
    ts = sorted(times)
    iv = {s: ts[s - 1] - ts[s - 2] for s in range(2, len(ts) + 1)}
    steady = statistics.median(iv[s] for s in range(150, 301))
    return {"steady_s": steady,
            "window_ratio": statistics.median(iv[s] for s in range(restored_step + 2, 61)) / steady,
            "refill_cost_s": sum(iv[s] - steady for s in range(restored_step + 2, 121)),
            "intervals": [round(iv[s], 4) for s in sorted(iv)]}


def main(pairs: int, out: str) -> None:
    from elastic import Trainer
    from benchmarks import straggler
    from benchmarks.output import scratch_dir
    from elastic.local_cluster import local_cluster
    from benchmarks.overhead import STEP_LOG_ENV, connect_with_env, read_step_log

    work = scratch_dir("elastic-bench-refill-")
    step_log = os.path.join(work, "steps.jsonl")
    rows = []
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(local_cluster(num_worker_nodes=4, cpus_per_node=1))
        connect_with_env(cluster, {STEP_LOG_ENV: step_log})
        for rep in range(pairs):
            for low in ([True, False] if rep % 2 == 0 else [False, True]):
                cluster.ensure_worker_nodes(4)
                open(step_log, "w").close()
                j = straggler.job("on", "file://" + os.path.join(work, "runs"))
                j["scaling"]["low_priority_refills"] = low
                j["train"]["optimizer"] = "benchmarks.overhead:timed_optimizer"
                res = Trainer(j).fit(progress=False)
                restored = res.events_of("restored")[-1]
                ready = [e for e in res.events_of("spare_ready") if e["t"] > restored["t"]]
                row = {"bench": "refill_priority", "rep": rep, "low_priority_refills": low,
                       "swaps": len(res.events_of("swapped")), "restored_step": restored["step"],
                       "spare_ready_after_s": ready[0]["t"] - restored["t"] if ready else None,
                       "started_low": ready[0].get("started_low") if ready else None,
                       "steps_per_s": straggler.steps_per_s(res),
                       **figures([x["t"] for x in read_step_log(step_log)], restored["step"])}
                print(json.dumps({k: v for k, v in row.items() if k != "intervals"}), flush=True)
                rows.append(row)
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for low in (True, False):
        mine = [r for r in rows if r["low_priority_refills"] is low]
        print(f"low_priority_refills={low}: median window_ratio "
              f"{statistics.median(r['window_ratio'] for r in mine):.3f}, refill_cost_s "
              f"{statistics.median(r['refill_cost_s'] for r in mine):.2f}, steps/s "
              f"{statistics.median(r['steps_per_s'] for r in mine):.2f}, spare ready after "
              f"{statistics.median(r['spare_ready_after_s'] or 0 for r in mine):.1f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
