"""elastic's DDP step before and after 146d9dc, in `python -m benchmarks overhead`'s setting: 2 ranks on the
2 one-CPU worker nodes of a local cluster, the benchmark's MLP and data path, 100 steps, no
checkpoint until the run's end. Runs alternate on one cluster (pairs alternate which goes first);
"before" puts back, from the model factory below, the strategy as it was (`Before` in
ddp_step_probe.py: gradients divided after their all-reduce, the statistics in a collective of
their own). Prints each run's median step after a warm-up of 10, and the medians per setting.
Usage: python benchmarks/probes/ddp_ab_probe.py [HIDDEN] [PAIRS]   (default 3072: 10.3 M parameters, 6 pairs)"""
import os
import statistics
import sys
import tempfile

FLAG_ENV = "DDP_AB_PROBE_BEFORE"


def build_model():
    """The benchmark's model; with the flag file present, the strategy as it was (runs in the worker)."""
    from elastic.workload import build_model as build
    from elastic.parallel import ddp
    if os.path.exists(os.environ[FLAG_ENV]):
        from ddp_step_probe import Before
        ddp.DataParallel._launch, ddp.DataParallel.reduce_gradients = Before._launch, Before.reduce_gradients
    return build()


def main() -> None:
    from alternating import alternating_runs

    hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 3072
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    work = tempfile.mkdtemp(prefix="ddp-ab-probe-")
    flag = os.path.join(work, "before")

    def prepare(job: dict, before: bool) -> None:
        if before:
            open(flag, "w").close()
        elif os.path.exists(flag):
            os.remove(flag)
        job["train"]["model"] = "ddp_ab_probe:build_model"
        job["checkpoint"]["every_steps"] = 1000  # only the run's final checkpoint, after the last step

    medians: dict[str, list[float]] = {"before": [], "now": []}
    for before, ends in alternating_runs(work, hidden, 100, pairs, {FLAG_ENV: flag}, prepare):
        setting = "before" if before else "now"
        medians[setting].append(statistics.median(b - a for a, b in zip(ends[10:], ends[11:])))
        print(f"{setting:6s}: median step {medians[setting][-1] * 1e3:.2f} ms", flush=True)
    before, now = (statistics.median(medians[k]) for k in ("before", "now"))
    wins = sum(b > n for b, n in zip(medians["before"], medians["now"]))
    print(f"hidden {hidden}: before {before * 1e3:.2f} ms, now {now * 1e3:.2f} ms a step (before / now "
          f"{before / now:.3f}); now faster in {wins} of {pairs} pairs")


if __name__ == "__main__":
    main()
