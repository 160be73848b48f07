"""elastic's DDP step before and after 146d9dc, in `elastic bench overhead`'s setting: 2 ranks on the
2 one-CPU worker nodes of a local cluster, the benchmark's MLP and data path, 100 steps, no
checkpoint until the run's end. Runs alternate on one cluster (pairs alternate which goes first);
"before" puts back, from the model factory below, the strategy as it was (`Before` in
ddp_step_probe.py: gradients divided after their all-reduce, the statistics in a collective of
their own). Prints each run's median step after a warm-up of 10, and the medians per setting.
Usage: python docs/bench/ddp_ab_probe.py [HIDDEN] [PAIRS]   (default 3072: 10.3 M parameters, 6 pairs)"""
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FLAG_ENV = "DDP_AB_PROBE_BEFORE"


def build_model():
    """The benchmark's model; with the flag file present, the strategy as it was (runs in the worker)."""
    from elastic.bench.workload import build_model as build
    from elastic.strategies import ddp
    if os.path.exists(os.environ[FLAG_ENV]):
        from ddp_step_probe import Before
        ddp.DataParallel._launch, ddp.DataParallel.reduce_gradients = Before._launch, Before.reduce_gradients
    return build()


def main() -> None:
    sys.path.insert(0, HERE)
    from elastic import Trainer
    from elastic.bench.local_cluster import local_cluster
    from elastic.bench.overhead import HIDDEN_ENV, STEP_LOG_ENV, _connect_with_env, elastic_job, read_step_log

    hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 3072
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    work = tempfile.mkdtemp(prefix="ddp-ab-probe-")
    step_log, flag = os.path.join(work, "steps.jsonl"), os.path.join(work, "before")
    medians: dict[str, list[float]] = {"before": [], "now": []}
    with local_cluster(num_worker_nodes=2, cpus_per_node=1) as cluster:
        _connect_with_env(cluster, {HIDDEN_ENV: str(hidden), STEP_LOG_ENV: step_log, FLAG_ENV: flag,
                                    "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])})
        for i in range(2 * pairs):
            setting = "before" if (i + i // 2) % 2 == 0 else "now"
            if setting == "before":
                open(flag, "w").close()
            elif os.path.exists(flag):
                os.remove(flag)
            open(step_log, "w").close()
            job = elastic_job(hidden, 100, "file://" + os.path.join(work, f"runs-{i}"))
            job["train"]["model"] = "ddp_ab_probe:build_model"
            job["checkpoint"]["every_steps"] = 1000  # only the run's final checkpoint, after the last step
            Trainer(job).fit(progress=False)
            ends = sorted(x["t"] for x in read_step_log(step_log))
            medians[setting].append(statistics.median(b - a for a, b in zip(ends[10:], ends[11:])))
            print(f"{setting:6s}: median step {medians[setting][-1] * 1e3:.2f} ms", flush=True)
    before, now = (statistics.median(medians[k]) for k in ("before", "now"))
    wins = sum(b > n for b, n in zip(medians["before"], medians["now"]))
    print(f"hidden {hidden}: before {before * 1e3:.2f} ms, now {now * 1e3:.2f} ms a step (before / now "
          f"{before / now:.3f}); now faster in {wins} of {pairs} pairs")


if __name__ == "__main__":
    main()
