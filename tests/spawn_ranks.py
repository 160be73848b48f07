"""Real Workers without Ray: one process per rank (spawned), gloo on this machine. Each rank
joins, restores (fresh init or the given checkpoints), trains, and reports what it ended with."""
from __future__ import annotations

import os

import torch

from elastic.checkpoint.fencing import write_fence
from elastic.checkpoint.layout import checkpoints_root
from elastic.config import JobConfig
from elastic.group.rendezvous import Rendezvous
from elastic.storage import Storage


_STORES: list[Rendezvous] = []  # kept for the test process's life: their ranks may still read them


def rendezvous_port() -> int:
    """The port of a new rendezvous store hosted in this (the test's) process, as the controller
    hosts one for its workers (elastic/group/rendezvous.py). A new one per call: the ranks of
    another test that used the same generation numbers must not find each other's keys."""
    _STORES.append(Rendezvous("127.0.0.1", timeout_s=120))
    return _STORES[-1].address()[1]


def _rank_main(rank, world, pp, job_json, root, port, candidates, steps, env, q):
    os.environ.update(env)
    from elastic.runtime.worker import Worker
    w = Worker(job_json, root)
    w.join("127.0.0.1", port, rank, world, generation=1, pp=pp)
    out = w.restore(candidates)
    res = w.run(steps, [])
    q.put((rank, res.status, res.digest or res.error, w._progress["loss"], out.source, out.step,
           {"grad_norm": w._progress.get("grad_norm"), "skipped": list(w.runner.skipped), "step": w.step,
            "lr": w.optimizer.param_groups[0]["lr"]}))
    w.leave()


def run_ranks(job: dict, pp: int = 1, candidates=(), steps=None, env=None, expect="done") -> list[tuple]:
    """Every rank of `job` as its own process, trained to `steps` (default run.num_steps).
    Returns per rank (rank, status, digest or error, loss, restore source, restored step, extra)."""
    jc = JobConfig.model_validate(job)
    world = jc.scaling.num_workers
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    root = checkpoints_root(jc.checkpoint.storage_uri, jc.run.name)
    # The controller's part: generation 1 in the fence before the group forms (no fence, no write).
    write_fence(Storage(jc.checkpoint.storage_uri, jc.checkpoint.storage_options), root, 1)
    port = rendezvous_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, pp, jc.model_dump_json(), root, port, list(candidates),
                                                  steps or jc.run.num_steps, env or {}, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = sorted(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    if expect is not None:
        assert all(o[1] == expect for o in out), out
    return out
