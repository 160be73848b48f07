"""The "Ray Train with torchft" peer of `python -m benchmarks recovery`.

Runs the common workload (docs/benchmarks/recovery.md: the MLP, data set, loss and
AdamW of `elastic.workload`, the sample order of `elastic.data.order.GlobalOrder`,
the same global batch) under Ray Train's replica-group recovery through torchft,
set up the way Ray's `torchft_linear_example.py` and torchft's own docs do it:

* `TorchTrainer(torch_config=TorchftConfig(lighthouse_kwargs=...), backend gloo)`:
  Ray Train starts one torchft lighthouse actor on the controller's node and
  treats every worker as a replica group of its own (`num_workers` groups of
  one worker). The lighthouse gets torchft's documented settings
  (`min_replicas=1`, `join_timeout_ms=10000`, `quorum_tick_ms=100`).
* In each worker: `torchft.Manager(min_replica_size=1, world_size=1, rank=0)`
  over a `ProcessGroupGloo`, `PGTransport` to heal a joining replica from a
  live peer's memory, `torchft.DistributedDataParallel` and `torchft.Optimizer`
  wrappers, timeouts as in the example (30 s process group and transport, 60 s
  manager). The loop runs while `manager.current_step() < num_steps`.
* `FailureConfig(max_failures)` so the controller retries at all; with torchft
  it then replaces only the failed replica group (`replace_replica_group`),
  the survivors keep their processes and keep stepping.
* Every `ckpt_every` committed steps every worker calls `ray.train.report`
  (the example's pattern; group 0 attaches a real checkpoint of the model,
  optimizer and manager state, the common workload's checkpoint cost). torchft
  itself never reads it back: a replacement heals from a peer instead.

Data: replica group `g` trains on slice `g` of the global batch of its current
step (`GlobalOrder.rank_indices(step, global_batch_size, num_workers, g)`). While
a group is missing its slice is simply not trained on and torchft averages the
gradients over the groups present: degraded steps use (num_workers - 1) /
num_workers of the global batch. That is how torchft works, not a choice here.

Fault: as in `ray_train_peer`, rank 1 runs `elastic.runtime.chaos.inject(fault)` (its
node killed, or frozen for `freeze_node`) when its manager has committed
`fault_step` steps, once per run (an O_EXCL marker file).

Figures, from a JSONL timeline under `storage_dir` that workers and the Ray
Train controller append to (wall-clock times, all on this machine). Every
worker logs each optimizer step: the manager's step after it, whether it was
committed, and `participants` (torchft's `num_participants()`: groups whose
gradient went into that step; a group healing in that step is not one):

* `recover_s`: fault injected -> the first committed step whose participants
  are all `num_workers` groups, i.e. the first step completed by the recovered
  full group (the earliest worker log of it; a committed step means the
  all-reduce over every group finished). Includes Ray noticing the lost worker,
  the replacement worker being scheduled on the spare node (after Ray
  reschedules the placement-group bundle of the dead node), its process and
  torchft manager starting, joining a quorum, healing (state copied from a
  peer over gloo) and one more full step. Same definition as `ray_train_peer`.
* `lost_steps`: `fault_step` minus the step that the first committed step after
  the fault was computed from: steps done before the fault that were done again
  (torchft survivors keep their state, so this is measured, typically 0).
* `detect_s`: fault -> the Ray Train controller's `after_exception` callback,
  i.e. Ray Train noticed the failed worker and goes on to replace its group.
  `degraded_s` is torchft's own reaction: fault -> first step committed by the
  survivors without the lost group.
* `steps_during_recovery`: distinct steps committed by the survivors between the
  fault and the first full-group step (all of them degraded steps).
* `heal_step`: the step the replacement was healed to; `heal_s` when.

If the full group never comes back before the run ends (the survivors may
finish first), `recover_s` is None, `full_group_back` is False and the record
says what happened; if `fit()` fails or hangs past `timeout_s`, this raises
with the timeline's summary. No figure is ever filled in. (Seen on the 3-group,
40-step workload: the survivors finished before the replacement started; it
then formed a quorum alone, trained from step 0 and hung in its first
`ray.train.report`, a barrier over all workers with no collective timeout.
After a timeout the caller must tear the cluster down: the run is still there.)

Needs a Ray cluster with a CPU on the driver's node for the lighthouse actor
(`local_cluster(..., head_cpus=1)`; training workers then request the worker
nodes' custom resource so none lands on the head) and `num_workers + 1` worker
nodes, so the lost group can be rescheduled.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer

from elastic.runtime import chaos  # after `import ray`: chaos needs psutil, which comes from Ray's vendored copy
from elastic import workload
from benchmarks.ray_train_peer import (EVENTS_FILE, FAULT_MARKER, TimelineCallback,
                                         check_recovery_args, log_event, read_events)
from elastic.data.order import GlobalOrder

SYSTEM = "ray-train-torchft"
CHECKPOINT_FILE = "state.pt"
# torchft's documented lighthouse settings (README / examples: --min_replicas 1
# --quorum_tick_ms 100 --join_timeout_ms 10000).
LIGHTHOUSE_KWARGS = {"min_replicas": 1, "join_timeout_ms": 10_000, "quorum_tick_ms": 100}
PG_TIMEOUT = timedelta(seconds=30)  # as Ray's example: generous enough to re-form gloo after a loss
MANAGER_TIMEOUT = timedelta(seconds=60)


# ---------------------------------------------------------------- timeline -> figures (pure)

def summarise(events: list[dict], *, num_workers: int, fault_step: int) -> dict:
    """Turn the timeline into the benchmark's figures (None where an event never happened).

    `step` events: {"rank", "before", "step" (manager step after), "committed", "participants",
    "t_start" (step begun), "t" (step done)}. Only steps begun after the fault count as post-fault
    work: the survivors may still be finishing the step the faulted group completed just before.
    """
    fault = next((e for e in sorted(events, key=lambda e: e["t"]) if e["event"] == "fault"), None)
    fault_t = fault["fault_t"] if fault is not None else float("inf")  # no fault: nothing below matches
    commits = sorted((e for e in events if e["event"] == "step" and e["committed"]
                      and e.get("t_start", e["t"]) >= fault_t), key=lambda e: e["t"])
    full = next((e for e in commits if e["participants"] >= num_workers), None)
    recover_t = full["t"] if full is not None else float("inf")
    survivors_degraded = [e for e in commits if e["participants"] < num_workers and e["t"] < recover_t
                          and e["rank"] != fault["rank"]]
    heals = sorted((e for e in events if e["event"] == "step" and e["t"] >= fault_t and e["step"] - e["before"] > 1),
                   key=lambda e: e["t"])
    saw = next((e for e in sorted(events, key=lambda e: e["t"])
                if e["event"] == "controller_saw_failure" and e["t"] >= fault_t), None)

    def since_fault(t: float | None) -> float | None:
        return t - fault_t if t is not None and fault is not None else None

    # The state a committed step was computed from is its step - 1 (the manager counts completed steps).
    resumed_step = min(e["step"] - 1 for e in commits) if commits else None
    return {
        "recover_s": since_fault(full["t"] if full is not None else None),
        "lost_steps": max(0, fault_step - resumed_step) if resumed_step is not None else None,
        "detect_s": since_fault(saw["t"] if saw is not None else None),
        "steps_during_recovery": len({e["step"] for e in survivors_degraded}) if fault is not None else None,
        "full_group_back": full is not None,
        "fault_step": fault["step"] if fault is not None else None,
        "resumed_step": resumed_step,
        "first_full_step": full["step"] if full is not None else None,
        "degraded_s": since_fault(survivors_degraded[0]["t"] if survivors_degraded else None),
        "heal_step": heals[0]["step"] - 1 if heals else None,
        "heal_s": since_fault(heals[0]["t"] if heals else None),
        "replacement_start_s": since_fault(next(
            (e["t"] for e in sorted(events, key=lambda e: e["t"])
             if e["event"] == "train_fn_start" and e.get("replacement")), None)),
        "controller_errors": saw["errors"] if saw is not None else None,
        "last_step_by_rank": _last_step_by_rank(events),
    }


def _last_step_by_rank(events: list[dict]) -> dict[str, int]:
    last: dict[str, int] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] == "step" and e["committed"]:
            last[str(e["rank"])] = e["step"]
    return last


# ---------------------------------------------------------------- the worker side

def build_replica(config: dict, replica_group: int):
    """The common workload's model and optimizer behind torchft's Manager and wrappers, as in Ray's
    example: (manager, ddp model, optimizer wrapper)."""
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    torch.manual_seed(config["seed"])  # same initial weights everywhere; torchft also syncs step 0
    module = workload.build_model()
    inner_optimizer = workload.build_optimizer(module.parameters())

    def state_dict() -> dict:
        return {"model": module.state_dict(), "optim": inner_optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        module.load_state_dict(state["model"])
        inner_optimizer.load_state_dict(state["optim"])

    pg = ProcessGroupGloo(timeout=PG_TIMEOUT)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        world_size=1,
        rank=0,
        replica_id=f"elastic_bench_{replica_group}",
        timeout=MANAGER_TIMEOUT,
        checkpoint_transport=PGTransport(pg, timeout=PG_TIMEOUT, device=torch.device("cpu")),
    )
    return manager, module, DistributedDataParallel(manager, module), Optimizer(manager, inner_optimizer)


def torchft_step(model, optimizer, dataset, indices: list[int]):
    """One step of a replica group on the samples `indices`; the manager's step advances if the
    quorum commits it. Returns the loss."""
    optimizer.zero_grad()  # starts the (async) quorum
    idx = torch.tensor(indices)
    loss = workload.loss_fn(model, (dataset.x[idx], dataset.y[idx]))
    loss.backward()  # torchft all-reduces over the groups in the quorum
    optimizer.step()  # steps only if the manager says commit
    return loss


def _maybe_inject_fault(config: dict, rank: int, step: int) -> None:
    """Rank 1, once per run, after `fault_step` committed steps: the marker (holding the fault time)
    is on disk before the node dies, so a later worker can tell it is a replacement."""
    if rank != 1 or step < config["fault_step"]:
        return
    marker = os.path.join(config["timeline_dir"], FAULT_MARKER)
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    fault_t = time.time()
    os.write(fd, json.dumps({"t": fault_t, "step": step, "rank": rank}).encode())
    os.close(fd)
    log_event(config["timeline_dir"], "fault", rank=rank, step=step, fault_t=fault_t)
    chaos.inject(config["fault"])


def report_step(config: dict, rank: int, step: int, loss: float, module, optimizer,
                manager) -> None:
    """Every worker reports (Ray Train's report is a barrier over all workers); group 0 attaches a
    checkpoint of the model, optimizer and manager state (torchft's docs: save the manager's too)."""
    metrics = {"step": step, "loss": loss}
    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                    "torchft": manager.state_dict(), "step": step}, os.path.join(tmp, CHECKPOINT_FILE))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    log_event(config["timeline_dir"], "checkpoint_reported", rank=rank, step=step)


def _train_loop(config: dict) -> None:
    """Per-worker training function: one replica group of one worker."""
    timeline_dir, num_steps = config["timeline_dir"], config["num_steps"]
    ctx = ray.train.get_context()
    rank, num_groups = ctx.get_world_rank(), ctx.get_world_size()
    replacement = os.path.exists(os.path.join(timeline_dir, FAULT_MARKER))
    log_event(timeline_dir, "train_fn_start", rank=rank, replacement=replacement)

    manager, module, model, optimizer = build_replica(config, rank)
    dataset = workload.build_dataset()
    order = GlobalOrder(len(dataset), config["seed"])
    global_batch = config["global_batch_size"]

    while manager.current_step() < num_steps:
        before = manager.current_step()
        _maybe_inject_fault(config, rank, before)
        t_start = time.time()
        loss = torchft_step(model, optimizer, dataset, order.rank_indices(before, global_batch, num_groups, rank))
        after = manager.current_step()
        committed = after > before
        log_event(timeline_dir, "step", rank=rank, before=before, step=after, committed=committed,
                   participants=manager.num_participants(), t_start=t_start)
        if committed and (after % config["ckpt_every"] == 0 or after >= num_steps):
            report_step(config, rank, after, float(loss.detach()), module, optimizer,
                        manager)

    log_event(timeline_dir, "train_fn_done", rank=rank, step=manager.current_step())
    # As the example: without it a finished survivor leaves the others waiting on its quorum.
    manager.shutdown()


# ---------------------------------------------------------------- the driver side

def _validate(num_workers: int, num_steps: int, fault_step: int, ckpt_every: int, global_batch_size: int,
              fault: str) -> None:
    if fault not in ("kill_node", "freeze_node"):
        raise ValueError(f"fault must be kill_node or freeze_node, got {fault!r}")
    check_recovery_args(num_workers, num_steps, fault_step, ckpt_every, global_batch_size, "run_torchft_recovery")


def _worker_resources(cluster) -> dict:
    """One CPU per worker, on a worker node: the head must keep a CPU free for the lighthouse."""
    if cluster is None:
        return {"CPU": 1}
    if getattr(cluster, "head_cpus", 0) < 1:
        raise RuntimeError("torchft's lighthouse actor is pinned to the driver's node and needs a CPU there: "
                           "start the cluster with local_cluster(..., head_cpus=1)")
    return {"CPU": 1, cluster.worker_node_resource: 1}


def _fit(trainer: TorchTrainer, timeout_s: float):
    """trainer.fit() with a deadline: a hang is reported, not waited out forever."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller below
            outcome["error"] = e

    thread = threading.Thread(target=target, name="torchft-peer-fit", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, TimeoutError(f"trainer.fit() still running after {timeout_s:.0f} s")
    return outcome.get("result"), outcome.get("error")


def run_torchft_recovery(
    storage_dir: str,
    num_workers: int,
    num_steps: int,
    fault_step: int,
    ckpt_every: int,
    global_batch_size: int,
    fault: str,
    cluster,
    *,
    seed: int = 0,
    max_failures: int = 3,
    timeout_s: float = 900.0,
) -> dict:
    """Train the common workload under Ray Train + torchft, fault rank 1's node after `fault_step`
    committed steps, measure the recovery (see the module docstring for each figure).

    `cluster`: the `elastic.local_cluster.LocalCluster` the driver is connected to (it must
    have `head_cpus >= 1`), or None on a user's own cluster. Returns one benchmark record; raises
    RuntimeError, with the timeline's summary, if the run fails or hangs past `timeout_s`.
    """
    _validate(num_workers, num_steps, fault_step, ckpt_every, global_batch_size, fault)
    from ray.train.v2.torch.torchft_config import TorchftConfig

    storage_dir = os.path.abspath(storage_dir)
    name = f"ray-train-torchft-recovery-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    timeline_dir = os.path.join(storage_dir, f"{name}-timeline")  # next to Ray Train's own run folder
    os.makedirs(timeline_dir)

    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"timeline_dir": timeline_dir, "num_steps": num_steps, "fault_step": fault_step,
                           "ckpt_every": ckpt_every, "global_batch_size": global_batch_size, "seed": seed,
                           "fault": fault},
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=False,
                                               resources_per_worker=_worker_resources(cluster)),
        torch_config=TorchftConfig(lighthouse_kwargs=dict(LIGHTHOUSE_KWARGS), backend="gloo"),
        run_config=ray.train.RunConfig(
            storage_path=storage_dir, name=name,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            callbacks=[TimelineCallback(timeline_dir)],
        ),
    )
    log_event(timeline_dir, "fit_start")
    t0 = time.time()
    result, error = _fit(trainer, timeout_s)
    total_s = time.time() - t0
    log_event(timeline_dir, "fit_done", error=repr(error) if error is not None else None)

    events = read_events(timeline_dir)
    summary = summarise(events, num_workers=num_workers, fault_step=fault_step)
    timeline = os.path.join(timeline_dir, EVENTS_FILE)
    if error is not None:
        raise RuntimeError(f"{SYSTEM}: the run did not complete ({type(error).__name__}: "
                           f"{str(error).strip()[:500]}); timeline {timeline}; summary {json.dumps(summary)}") from error
    done = [e for e in events if e["event"] == "train_fn_done"]
    return {
        "bench": "recovery",
        "system": SYSTEM,
        "fault": fault,
        **summary,
        "final_step": (result.metrics or {}).get("step", max((e["step"] for e in done), default=None)),
        "total_s": total_s,
        "num_workers": num_workers,
        "ckpt_every": ckpt_every,
        "global_batch_size": global_batch_size,
        "params": sum(p.numel() for p in workload.build_model().parameters()),
        "timeline": timeline,
    }
