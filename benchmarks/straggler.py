"""`python -m benchmarks straggler`: steps/s with rank 1 slowed 3x (a real busy-wait inside its compute),
mitigation on (swap for a warm spare) vs off, both divided by the rate without a slowdown, all in
one run on the same local cluster, interleaved per repetition.

The workload is the common MLP with a larger global batch than the recovery benchmark so that
compute, not the all-reduce, dominates a step: a straggler only hurts where compute matters.
"""
from __future__ import annotations

import contextlib
import os
import uuid

from benchmarks.output import emit, markdown_table, medians, scratch_dir, write_outputs

NUM_WORKERS, NUM_STEPS, SLOW_STEP, FACTOR, GLOBAL_BATCH = 3, 300, 10, 3.0, 1536
CONFIGS = ["no-slowdown", "off", "on"]


def job(config: str, storage_uri: str, strategy: str = "ddp") -> dict:
    j = {
        "run": {"name": f"bench-straggler-{uuid.uuid4().hex[:8]}", "num_steps": NUM_STEPS, "seed": 0},
        # A spare in every configuration, so that only the mitigation differs.
        "scaling": {"num_workers": NUM_WORKERS, "num_spares": 1, "wait_for_spares": True},
        "stragglers": {"enabled": config == "on", "threshold": 1.5, "window_steps": 4, "consecutive_windows": 2},
        "checkpoint": {"storage_uri": storage_uri, "every_steps": 50},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "optimizer": "elastic.workload:build_optimizer",
                  "global_batch_size": GLOBAL_BATCH, "strategy": strategy},
    }
    if config != "no-slowdown":
        j["chaos"] = [{"action": "slow", "rank": 1, "at_step": SLOW_STEP, "factor": FACTOR}]
    return j


def steps_per_s(result) -> float:
    """Training rate from the first restore (step 0, group formed) to the end of the run."""
    start = result.events_of("restored")[0]["t"]
    end = result.events_of("run_finished")[0]["t"]
    return NUM_STEPS / (end - start)


def steps_per_s_after_swap(result) -> float | None:
    """Rate from the swapped-in group's restore to the end: the steady state mitigation buys."""
    if not result.events_of("swapped"):
        return None
    restored = result.events_of("restored")[-1]
    end = result.events_of("run_finished")[0]["t"]
    return (NUM_STEPS - restored["step"]) / (end - restored["t"])


def main(args) -> int:
    from elastic import Trainer
    from elastic.local_cluster import local_cluster

    records: list[dict] = []
    work = scratch_dir("elastic-bench-")
    storage_uri = "file://" + os.path.join(work, "runs")
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(local_cluster(num_worker_nodes=NUM_WORKERS + 1, cpus_per_node=1))
        for rep in range(args.reps):
            rates = {}
            for config in CONFIGS:
                cluster.ensure_worker_nodes(NUM_WORKERS + 1)
                result = Trainer(job(config, storage_uri, args.strategy)).fit(progress=False)
                rates[config] = steps_per_s(result)
                swaps = result.events_of("swapped")
                rec = {"bench": "straggler", "system": "elastic", "strategy": args.strategy, "mitigation": config,
                       "rep": rep,
                       "steps_per_s": rates[config], "num_swaps": len(swaps),
                       "swap_after_steps": (result.events_of("restored")[-1]["step"] - SLOW_STEP) if swaps else None,
                       # the last step the policy had seen when it decided (the rest is the planned stop)
                       "decided_after_steps": next((d["step"] - SLOW_STEP for d in result.events_of("decision")
                                                    if d["decision"] == "Swap" and d.get("step") is not None), None),
                       "factor": FACTOR, "slow_from_step": SLOW_STEP, "num_steps": NUM_STEPS,
                       "global_batch": GLOBAL_BATCH,
                       # ddp: every replica's digest; fsdp: the whole state, gathered (one digest)
                       "replicas_identical": len(set(result.digests.values())) == 1}
                if config != "no-slowdown":
                    rec["straggler_ratio"] = rates[config] / rates["no-slowdown"]
                after = steps_per_s_after_swap(result)
                if after is not None:
                    rec["steady_ratio_after_swap"] = after / rates["no-slowdown"]
                records.append(rec)
                emit(rec)
    slowed = [r for r in records if r["mitigation"] != "no-slowdown"]
    metrics = ["straggler_ratio", "steady_ratio_after_swap", "steps_per_s", "decided_after_steps", "swap_after_steps"]
    med = medians(slowed, metrics, key="mitigation")
    base = medians([r for r in records if r["mitigation"] == "no-slowdown"], ["steps_per_s"], key="mitigation")
    notes = [f"rank 1 computes {FACTOR:g}x slower from step {SLOW_STEP} of {NUM_STEPS}; {args.strategy}, "
             f"{NUM_WORKERS} workers + 1 spare on a local cluster; MLP 1.3M params, global batch {GLOBAL_BATCH}; "
             f"no-slowdown median {base['no-slowdown']['steps_per_s']:.2f} steps/s; "
             "straggler_ratio = whole-run steps/s / no-slowdown steps/s of the same repetition; "
             "steady_ratio_after_swap = the same from the swapped-in group's first step to the end; "
             "decided_after_steps = slow steps the policy had seen when it decided; "
             "swap_after_steps = steps run slow before the swap"]
    table = markdown_table(med, metrics, "straggler (mitigation on vs off)", notes)
    print(table)
    if args.out:
        write_outputs(args.out, "straggler", slowed, table, "straggler_ratio", key="mitigation")
        print(f"wrote {args.out}/results.jsonl, results.md, straggler.png")
    return 0
