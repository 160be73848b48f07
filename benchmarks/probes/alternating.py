"""Two settings of elastic DDP run alternately on one local cluster: the harness of the probes in
this folder (gc_probe.py, ckpt_cost_probe.py, ddp_ab_probe.py).

The setting is the overhead benchmark's: 2 ranks on the 2 one-CPU worker nodes of a local cluster,
its MLP (`hidden` wide) and data path, steps timed by its optimizer hook on rank 0. Pairs alternate
which setting runs first (A B, B A, A B, ...), so neither always runs on a fresher machine. The
probe's own module is on the workers' path, so a job's `train.model` may name a factory of it."""
from __future__ import annotations

import os
import sys
from typing import Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))


def alternating_runs(work: str, hidden: int, steps: int, pairs: int, env: dict[str, str],
                     prepare: Callable[[dict, bool], None]) -> Iterator[tuple[bool, list[float]]]:
    """Runs 2 x `pairs` jobs of `steps` steps, their checkpoints and step log in the folder `work`;
    `prepare(job, first)` adjusts each job (and whatever the probe's factory reads) before it runs,
    `first` telling which setting. Yields per run (first, the steps' end times in order). `env`
    reaches the workers."""
    sys.path.insert(0, HERE)
    from elastic import Trainer
    from elastic.local_cluster import local_cluster
    from benchmarks.overhead import HIDDEN_ENV, STEP_LOG_ENV, connect_with_env, elastic_job, read_step_log

    step_log = os.path.join(work, "steps.jsonl")
    with local_cluster(num_worker_nodes=2, cpus_per_node=1) as cluster:
        connect_with_env(cluster, {HIDDEN_ENV: str(hidden), STEP_LOG_ENV: step_log, **env,
                                    "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])})
        for i in range(2 * pairs):
            first = (i + i // 2) % 2 == 0
            open(step_log, "w").close()
            job = elastic_job(hidden, steps, "file://" + os.path.join(work, f"runs-{i}"))
            prepare(job, first)
            Trainer(job).fit(progress=False)
            yield first, sorted(x["t"] for x in read_step_log(step_log))
