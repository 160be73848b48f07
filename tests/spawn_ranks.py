"""Real Workers without Ray: one process per rank, gloo on this machine. Each rank joins, restores
(fresh init or the given checkpoints), trains, and reports what it ended with.

Ranks are forked from a forkserver that imported torch and the worker once
(tests/support/rank_preload.py), not spawned: a fork of a process that only imported modules (no
thread, no tensor op, no process group yet) starts as clean as a fresh interpreter, without
paying the imports again. Each rank's environment is the forkserver's (taken when it started)
plus `env`."""
from __future__ import annotations

import os
import resource

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


def _rank_main(rank, world, pp, job_json, root, port, candidates, steps, env, q, data_limit_mb=None, probe=None,
               peer=None, start_probe=None, ring=False):
    os.environ.update(env)
    from elastic.runtime.actor import import_worker
    Worker = import_worker()  # as a Ray worker does it (the collector off while torch's modules import)
    if data_limit_mb is not None:
        # A hard cap on the private memory this rank may commit (heap and anonymous mappings, what
        # tensors live in): past it an allocation fails, and the rank reports the error.
        resource.setrlimit(resource.RLIMIT_DATA, (data_limit_mb * 2 ** 20, data_limit_mb * 2 ** 20))
    w = Worker(job_json, root)
    w.join("127.0.0.1", port, rank, world, generation=1, pp=pp)
    try:
        out = w.restore(candidates)
        if peer is not None:  # a fault at step peer["at"]: the ranks not in "sources" are replaced
            w.run(peer["at"], [])
            w.leave()  # (after its persist in flight: generation 1 may write until the fence moves on)
            if rank == 0:  # the controller's part: generation 2 in the fence before the group forms
                write_fence(w.storage, root, 2)
            if peer["mapping"] is not None:  # a trade: every rank keeps its Worker, some under a new number
                rank = peer["mapping"].get(rank, rank)
            elif rank not in peer["sources"]:
                w = Worker(job_json, root)  # nothing built, as a replacement starts
            w.join("127.0.0.1", port, rank, world, generation=2, pp=pp)
            out = w.restore_from_peer(peer["sources"][0], peer["sources"])
        restored_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the build's peak
        started = _probe(start_probe, w.model)  # what the restore (or the fresh start) left
        ring_args = ({"buddy": ((rank + 1) % world, None), "holds_for": ((rank - 1) % world,)}
                     if ring else {})
        res = w.run(steps, [], **ring_args)
    except Exception as e:  # noqa: BLE001 - reported (a memory cap that is too low fails here)
        q.put((rank, "error", f"{type(e).__name__}: {e}", None, None, None,
               {"maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return
    q.put((rank, res.status, res.digest or res.error, w._progress["loss"], out.source, out.step,
           {"grad_norm": w._progress.get("grad_norm"), "skipped": list(w.runner.skipped), "step": w.step,
            "lr": w.optimizer.param_groups[0]["lr"],
            "frozen_in_optim": _frozen_in(w.optimizer),
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "restored_rss_mb": restored_rss,
            "vmdata_mb": _vm_data_mb(), "mesh": w.mesh.mesh_dim_names,
            "placements": str(getattr(next(w.model.parameters()), "placements", None)),
            "probe": _probe(probe, w.model), "start_probe": started,
            "snapshot_is_the_copy": getattr(w.ckpt, "shares_copies", None)}))
    w.leave()


def _probe(ref: str | None, model):
    """What `module:function(model)` says about the rank's model at the end (a set as a frozenset)."""
    if ref is None:
        return None
    import importlib
    mod, fn = ref.split(":")
    got = getattr(importlib.import_module(mod), fn)(model)
    return frozenset(got) if isinstance(got, set) else got


def _frozen_in(optimizer) -> int:
    """Parameters with requires_grad=False that `optimizer` holds, in a param group or a state."""
    held = [*(p for g in optimizer.param_groups for p in g["params"]), *optimizer.state]
    return sum(not p.requires_grad for p in held)


def _vm_data_mb() -> float:
    """This process's private writable memory now (what RLIMIT_DATA caps), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_ranks(job: dict, pp: int = 1, candidates=(), steps=None, env=None, expect="done",
              data_limit_mb: int | None = None, probe: str | None = None,
              peer_sources: list[int] | None = None, peer_at: int | None = None,
              renumber: dict[int, int] | None = None,
              start_probe: str | None = None, ring: bool = False) -> list[tuple]:
    """Every rank of `job` as its own process, trained to `steps` (default run.num_steps).
    Returns per rank (rank, status, digest or error, loss, restore source, restored step, extra).
    `data_limit_mb`: each rank's RLIMIT_DATA, set before it builds anything. `probe`:
    module:function(model) whose answer at the end is extra["probe"]; `start_probe`'s, right
    after the first restore, is extra["start_probe"]. `peer_sources` (one rank
    per slot) and `peer_at`: a fault after step `peer_at` replaces every other rank with a new
    Worker (nothing built); the group forms again and restores from the sources' memory
    (`restore_from_peer`), as after a failure, then trains on. With `renumber` (old rank -> new
    rank) no rank is replaced: each forms the new group under its new number with the state it
    holds, as after a trade (elastic/controller/regroup.py), and reports under it. `ring`: each
    rank's buddy for checkpoint.memory_sync's copies is the next rank."""
    jc = JobConfig.model_validate(job)
    world = jc.scaling.num_workers
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.spawn_ranks", "tests.support.rank_preload"])  # before its first start
    q = ctx.Queue()
    root = checkpoints_root(jc.checkpoint.storage_uri, jc.run.name)
    # The controller's part: generation 1 in the fence before the group forms (no fence, no write).
    write_fence(Storage(jc.checkpoint.storage_uri, jc.checkpoint.storage_options), root, 1)
    port = rendezvous_port()
    peer = None if peer_sources is None else {"sources": list(peer_sources), "at": peer_at, "mapping": renumber}
    procs = [ctx.Process(target=_rank_main, args=(r, world, pp, jc.model_dump_json(), root, port, list(candidates),
                                                  jc.run.num_steps if steps is None else steps, env or {}, q,
                                                  data_limit_mb, probe, peer, start_probe, ring))
             for r in range(world)]
    out = gather_ranks(procs, q)
    if expect is not None:
        assert all(o[1] == expect for o in out), out
    return out


def gather_ranks(procs, q, timeout_s: float = 600) -> list[tuple]:
    """Start `procs` (one per rank), then what each put on `q`: tuples sorted by their first
    item (the rank)."""
    for p in procs:
        p.start()
    out = sorted((q.get(timeout=timeout_s) for _ in procs), key=lambda o: o[0])
    for p in procs:
        p.join(timeout=60)
    return out


def uninterrupted_digests(job: dict) -> dict[int, str]:
    """{rank: digest} that an uninterrupted run of `job` ends with, its ranks forked here without
    Ray: the same Worker code as on a cluster, so the same digests, in a fraction of the time (no
    actor starts, no torch import per rank). tests/test_chaos.py's baseline checks the two agree."""
    jc = JobConfig.model_validate(job)
    pp = jc.train.pipeline.stages if jc.train.strategy == "pipeline" else 1
    return {o[0]: o[2] for o in run_ranks({**job, "chaos": []}, pp=pp)}
