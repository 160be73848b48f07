"""`make demo`: train a small character-level LM on an embedded local Ray cluster
(a head plus four one-CPU nodes), kill the node hosting rank 1 part way, and
show the recovery. Run from the repository root: `python examples/demo.py`."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.getcwd())  # so workers and driver import `examples.charlm` alike

from elastic import Trainer  # noqa: E402
from elastic.local_cluster import local_cluster  # noqa: E402
from elastic.config import load_job  # noqa: E402
from elastic.observability.timeline import plot  # noqa: E402
from elastic.observability.trace import load_steps, write_trace  # noqa: E402


def main() -> int:
    job = load_job(os.path.join(os.path.dirname(__file__), "demo.yaml"))
    job = job.model_copy(update={"run": job.run.model_copy(update={"name": f"demo-{time.strftime('%Y%m%d-%H%M%S')}"})})
    print("elastic demo: 3 DDP workers and 1 warm spare on a local Ray cluster (head + 4 one-CPU nodes);\n"
          f"the node of rank {job.chaos[0].rank} is killed after step {job.chaos[0].at_step}.\n"
          "Starting the cluster (about 15 s)...", flush=True)
    with local_cluster(num_worker_nodes=4, cpus_per_node=1):
        result = Trainer(job).fit()
    print(result.summary())
    run_dir = result.run_dir.removeprefix("file://")
    title = f"{job.run.name}: {job.chaos[0].action} on rank {job.chaos[0].rank}"
    png, trace = os.path.join(run_dir, "timeline.png"), os.path.join(run_dir, "trace.json")
    plot(result.events, png, title=title)
    write_trace(result.events, trace, title=title, steps=load_steps(run_dir))
    print(f"timeline of the run (states, fault, recovery, checkpoints): {png}\n"
          f"the same as a trace, one track per rank with each step's compute and waiting "
          f"(open it in https://ui.perfetto.dev): {trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
