"""The Ray Train peer of `python -m benchmarks recovery`.

Runs the common workload (elastic/workload.py) under Ray Train's own
fault tolerance, the way its documentation says to use it: `TorchTrainer`,
DDP through `prepare_model`, a checkpoint every `ckpt_every` steps written by
rank 0 and reported with `ray.train.report`, `FailureConfig(max_failures)`
restarting the worker group, and `ray.train.get_checkpoint()` to resume. One
node loss (the node of rank 1) is injected at a fixed step with
`elastic.runtime.chaos.kill_own_node`, and the run's timeline is turned into the
`recover_s` / `lost_steps` / `detect_s` figures.

The timeline is a JSONL file under `storage_dir` that the driver, the Ray
Train controller (a `UserCallback`) and the workers all append to. That only
works because every Ray node of the local cluster runs on this machine and
sees the same filesystem, and it is why every timestamp is wall-clock
`time.time()`: monotonic clocks are not comparable across processes.

Expects the caller to be connected to a Ray cluster with at least
`num_workers + 1` one-CPU worker nodes (`elastic.local_cluster`), so the
worker group can be rescheduled after a node is lost.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
import uuid
from typing import Any

import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer, prepare_model

from elastic.runtime import chaos  # after `import ray`: chaos needs psutil, which comes from Ray's vendored copy
from elastic import workload

EVENTS_FILE = "events.jsonl"
FAULT_MARKER = "fault.marker"
CHECKPOINT_FILE = "state.pt"


def log_event(timeline_dir: str, event: str, **fields: Any) -> None:
    """Append one event with a wall-clock timestamp.

    One `os.write` on an O_APPEND descriptor per line, so lines from several
    processes never interleave.
    """
    line = json.dumps({"event": event, "t": time.time(), **fields}) + "\n"
    fd = os.open(os.path.join(timeline_dir, EVENTS_FILE), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def fire_fault_once(timeline_dir: str, rank: int, step: int, fault: str) -> None:
    """Inject `fault` from this rank unless it fired already in this run: O_EXCL on the marker
    makes the claim atomic and the fault fire once per run, whatever restarts follow; the marker
    (holding the fault time) is on disk before the node dies."""
    try:
        fd = os.open(os.path.join(timeline_dir, FAULT_MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    fault_t = time.time()
    os.write(fd, json.dumps({"t": fault_t, "step": step, "rank": rank}).encode())
    os.close(fd)
    log_event(timeline_dir, "fault", rank=rank, step=step, fault_t=fault_t)
    chaos.inject(fault)


def read_events(timeline_dir: str) -> list[dict]:
    path = os.path.join(timeline_dir, EVENTS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class TimelineCallback(ray.train.UserCallback):
    """Runs inside the Ray Train controller: records when it sees a failure and which reports it registered.

    `after_exception` fires on the controller's first worker-group poll that
    returns an error, i.e. the moment Ray Train has noticed the failure and
    goes on to restart; that is the peer's `detect_s`.
    """

    def __init__(self, timeline_dir: str):
        self.timeline_dir = timeline_dir

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        errors = {rank: f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
                  for rank, e in worker_exceptions.items()}
        log_event(self.timeline_dir, "controller_saw_failure", errors=errors)

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        log_event(self.timeline_dir, "controller_registered_report",
                   step=metrics[0].get("step"), checkpoint=checkpoint is not None)


def resume_workload(seed: int, strategy: str = "ddp", use_gpu: bool = False, tp: int = 1):
    """The common workload's model and optimizer from the seed, then Ray Train's latest checkpoint
    if there is one, the model wrapped for DDP (or sharded with FSDP2: benchmarks/ray_train_fsdp.py;
    tp > 1: examples/gpt.py split over tp, benchmarks/ray_train_tp.py):
    (model, optimizer, completed steps, checkpoint or None, the (dp, tp) mesh or None)."""
    if strategy == "fsdp" or tp > 1:
        return _resume_distributed(seed, strategy, use_gpu, tp)
    torch.manual_seed(seed)  # same initial weights on every rank, before any checkpoint overrides them
    model = workload.build_model()
    optimizer_state = None
    step = 0  # completed optimizer steps
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            state = torch.load(os.path.join(ckpt_dir, CHECKPOINT_FILE), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer_state = state["optimizer"]
        step = state["step"]
    model = prepare_model(model)  # DDP over gloo; also broadcasts rank 0's weights
    optimizer = workload.build_optimizer(model.parameters())
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)  # every rank: optimizer state is not synchronised by DDP
    return model, optimizer, step, checkpoint, None


def _resume_distributed(seed: int, strategy: str, use_gpu: bool, tp: int):
    """FSDP2 or tensor parallelism: every rank builds its own part, then reads it from the merged
    distributed checkpoint (resume_workload's return)."""
    from benchmarks import ray_train_fsdp
    world, mesh = ray.train.get_context().get_world_size(), None
    if tp > 1:
        from benchmarks import ray_train_tp
        model, optimizer, mesh = ray_train_tp.build(seed, strategy, tp, world, use_gpu)
    else:
        torch.manual_seed(seed)
        model = ray_train_fsdp.shard(workload.build_model(), world, use_gpu)
        optimizer = workload.build_optimizer(model.parameters())
    step, checkpoint = 0, ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            step = ray_train_fsdp.load(model, optimizer, ckpt_dir)
    return model, optimizer, step, checkpoint, mesh


def train_step(model, optimizer, dataset, step: int, global_batch: int, rank: int, per_rank_batch: int):
    """One optimizer step. The global batch of step s is a fixed slice of the sample order, cut
    evenly across ranks: resuming at step s, at any world size, sees exactly the same data."""
    num_samples = len(dataset)
    start = (step * global_batch + rank * per_rank_batch) % num_samples
    idx = (torch.arange(per_rank_batch) + start) % num_samples
    device = next(model.parameters()).device  # prepare_model's: the worker's GPU under use_gpu
    optimizer.zero_grad(set_to_none=True)
    loss = workload.loss_fn(model, (dataset.x[idx].to(device), dataset.y[idx].to(device)))
    loss.backward()  # DDP all-reduces gradients here
    optimizer.step()
    return loss


def unwrapped(model):
    """The model `prepare_model` wrapped: it wraps in DDP only at a world size above one."""
    return getattr(model, "module", model)


def report_step(model, optimizer, step: int, metrics: dict, rank: int, ckpt_every: int, num_steps: int,
                timeline_dir: str, strategy: str = "ddp", **log_fields) -> None:
    """Ray Train's documented pattern: every `ckpt_every` steps rank 0 writes the (replicated) DDP
    state and every rank calls report, so the controller can pair them up; the checkpoint counts
    once all ranks' reports are polled. The final step is reported too, for Result.metrics. FSDP:
    every rank writes and reports its own shards (distributed checkpointing), as with tp."""
    if step % ckpt_every == 0 and strategy in ("fsdp", "tp"):
        from benchmarks import ray_train_fsdp
        with tempfile.TemporaryDirectory() as tmp:
            ray_train_fsdp.save(model, optimizer, step, tmp, rank)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        log_event(timeline_dir, "checkpoint_reported", rank=rank, step=step, **log_fields)
    elif step % ckpt_every == 0:
        if rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                torch.save({"model": unwrapped(model).state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                           os.path.join(tmp, CHECKPOINT_FILE))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            log_event(timeline_dir, "checkpoint_reported", rank=rank, step=step, **log_fields)
        else:
            ray.train.report(metrics)
    elif step == num_steps:
        ray.train.report(metrics)


def _train_loop(config: dict) -> None:
    """The per-worker training function (runs in each Ray Train worker process)."""
    timeline_dir = config["timeline_dir"]
    num_steps, fault_step, ckpt_every = config["num_steps"], config["fault_step"], config["ckpt_every"]
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    per_rank_batch = config["global_batch_size"] // world_size
    # The fault marker exists iff the fault has fired: an attempt starting
    # after it is a recovery attempt.
    fault_marker = os.path.join(timeline_dir, FAULT_MARKER)
    is_recovery = os.path.exists(fault_marker)

    strategy, tp = config.get("strategy", "ddp"), config.get("tp", 1)
    model, optimizer, step, checkpoint, mesh = resume_workload(config["seed"], strategy, config.get("use_gpu", False),
                                                               tp)
    log_event(timeline_dir, "train_fn_start", rank=rank, resume_step=step, recovery=is_recovery,
               checkpoint=checkpoint.path if checkpoint is not None else None)

    if tp > 1:
        from benchmarks import ray_train_tp
        from elastic.data.order import GlobalOrder
        from examples import gpt
        dataset = gpt.build_dataset()
        order = GlobalOrder(len(dataset), config["seed"])
    else:
        dataset = workload.build_dataset()
    global_batch = config["global_batch_size"]

    first_step_logged = False
    while step < num_steps:
        if rank == config.get("fault_rank", 1) and step == fault_step:
            fire_fault_once(timeline_dir, rank, step, config.get("fault", "kill_node"))

        if tp > 1:
            loss = ray_train_tp.train_step(model, optimizer, dataset, order, step, global_batch, mesh, strategy)
        else:
            loss = train_step(model, optimizer, dataset, step, global_batch, rank, per_rank_batch)
        step += 1

        if rank == 0 and is_recovery and not first_step_logged:
            log_event(timeline_dir, "first_step_after_recovery", rank=rank, step=step)
            first_step_logged = True

        metrics = {"step": step, "loss": float(loss.detach())}
        report_step(model, optimizer, step, metrics, rank, ckpt_every, num_steps, timeline_dir,
                    "tp" if tp > 1 else strategy)
    if rank == 0:
        log_event(timeline_dir, "train_fn_done", rank=rank, step=step)


def summarise(events: list[dict], *, fault_step: int) -> dict:
    """Turn the timeline into the benchmark's figures (None where an event never happened)."""
    def first(name: str, after: float, **match: Any) -> dict | None:
        hits = [e for e in events
                if e["event"] == name and e["t"] >= after and all(e.get(k) == v for k, v in match.items())]
        return min(hits, key=lambda e: e["t"]) if hits else None

    def since_fault(event: dict | None) -> float | None:
        return event["t"] - fault_t if event is not None else None

    fault = first("fault", after=float("-inf"))
    fault_t = fault["fault_t"] if fault is not None else float("inf")  # no fault: nothing below matches
    saw = first("controller_saw_failure", after=fault_t)
    restart = first("train_fn_start", after=fault_t, rank=0)
    resumed_step = restart["resume_step"] if restart is not None else None
    return {
        "recover_s": since_fault(first("first_step_after_recovery", after=fault_t)),
        "lost_steps": fault_step - resumed_step if resumed_step is not None else None,
        "detect_s": since_fault(saw),
        "fault_step": fault["step"] if fault is not None else None,
        "resumed_step": resumed_step,
        # Where the time goes: fault -> controller notices (detect_s) -> train
        # function running again on rank 0, i.e. new worker group up and
        # checkpoint loaded (restart_s) -> first step done (recover_s).
        "restart_s": since_fault(restart),
        "controller_errors": saw["errors"] if saw is not None else None,
        # Ray Train counts a checkpoint only once the controller has polled the
        # report of every rank; these two lists show which ones it lost.
        "checkpoints_reported_before_fault": sorted(
            e["step"] for e in events if e["event"] == "checkpoint_reported" and e["t"] < fault_t),
        "checkpoints_registered_before_fault": sorted(
            e["step"] for e in events
            if e["event"] == "controller_registered_report" and e["checkpoint"] and e["t"] < fault_t),
        "num_restarts": max(0, sum(1 for e in events if e["event"] == "train_fn_start" and e["rank"] == 0) - 1),
    }


def check_recovery_args(num_workers: int, num_steps: int, fault_step: int, ckpt_every: int, global_batch_size: int,
                        who: str, fault_rank: int = 1) -> None:
    """What every recovery peer needs of its arguments, and a connected Ray cluster."""
    if not 0 <= fault_rank < num_workers:
        raise ValueError(f"num_workers must be > {fault_rank} (the fault targets rank {fault_rank}), got {num_workers}")
    if not 0 < fault_step < num_steps:
        raise ValueError(f"fault_step must be in (0, num_steps={num_steps}), got {fault_step}")
    if ckpt_every < 1:
        raise ValueError(f"ckpt_every must be >= 1, got {ckpt_every}")
    if global_batch_size % num_workers:
        raise ValueError(f"global_batch_size ({global_batch_size}) must be divisible by num_workers ({num_workers})")
    if not ray.is_initialized():
        raise RuntimeError(f"{who} needs a connected Ray cluster (see elastic.local_cluster)")


def run_storage(storage_dir: str, s3) -> dict:
    """RunConfig's storage arguments: local disk, or the S3 endpoint of `s3` (path = bucket/prefix)."""
    if s3 is None:
        return {"storage_path": storage_dir}
    import pyarrow.fs

    from tests.support.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY
    scheme, endpoint = s3.endpoint_url.split("://", 1)
    fs = pyarrow.fs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, endpoint_override=endpoint,
                                 scheme=scheme, region=REGION)
    return {"storage_path": f"{s3.bucket}/ray-train", "storage_filesystem": fs}


def run_ray_train_recovery(
    *,
    storage_dir: str,
    num_workers: int = 3,
    num_steps: int = 40,
    fault_step: int = 25,
    ckpt_every: int = 10,
    global_batch_size: int = 96,
    seed: int = 0,
    max_failures: int = 3,
    fault: str = "kill_node",
    s3=None,
    fault_rank: int = 1,
    use_gpu: bool = False,
    strategy: str = "ddp",
    tp: int = 1,
    cpus_per_worker: float = 1,
) -> dict:
    """Train the common workload with Ray Train, fault rank `fault_rank`'s node after `fault_step` steps
    (kill it, or freeze it: `elastic.runtime.chaos` actions; or `kill_process`, its process alone), measure the
    recovery. `use_gpu`: one GPU per worker, NCCL (`ScalingConfig(use_gpu=True)`). `strategy`: "ddp"
    (prepare_model) or "fsdp" (FSDP2 and distributed checkpointing: benchmarks/ray_train_fsdp.py).
    `tp` > 1: examples/gpt.py split over tp ranks, ddp or fsdp over the rest (benchmarks/ray_train_tp.py),
    `cpus_per_worker` CPUs each.

    Needs `ray.init` done (on a cluster with a spare node). Returns one
    benchmark record (see docs/benchmarks/recovery.md), plus `restart_s` and the
    checkpoint steps reported vs registered by Ray Train before the fault.

    `s3` (an `tests.support.seaweedfs.S3Server`): Ray Train's checkpoints go to that S3
    endpoint, through the pyarrow S3 filesystem its docs name for `RunConfig.storage_filesystem`;
    otherwise to `storage_dir` on local disk. The timeline stays on local disk either way.
    """
    check_recovery_args(num_workers, num_steps, fault_step, ckpt_every, global_batch_size, "run_ray_train_recovery",
                        fault_rank)

    storage_dir = os.path.abspath(storage_dir)
    name = f"ray-train-recovery-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    # Next to, not inside, Ray Train's own run folder, which it manages.
    timeline_dir = os.path.join(storage_dir, f"{name}-timeline")
    os.makedirs(timeline_dir)

    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={
            "timeline_dir": timeline_dir, "num_steps": num_steps, "fault_step": fault_step,
            "ckpt_every": ckpt_every, "global_batch_size": global_batch_size, "seed": seed, "fault": fault,
            "fault_rank": fault_rank, "strategy": strategy, "use_gpu": use_gpu, "tp": tp,
        },
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                               resources_per_worker={"CPU": cpus_per_worker,
                                                                     **({"GPU": 1} if use_gpu else {})}),
        run_config=ray.train.RunConfig(
            **run_storage(storage_dir, s3),
            name=name,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            callbacks=[TimelineCallback(timeline_dir)],
        ),
    )
    log_event(timeline_dir, "fit_start")
    t0 = time.time()
    result = trainer.fit()
    total_s = time.time() - t0
    log_event(timeline_dir, "fit_done")

    events = read_events(timeline_dir)
    done = [e for e in events if e["event"] == "train_fn_done"]
    final_step = (result.metrics or {}).get("step", done[-1]["step"] if done else None)
    out = {
        "bench": "recovery",
        "system": "ray-train",
        "strategy": strategy,
        "tp": tp,
        "storage": "s3" if s3 is not None else "file",
        "fault": fault,
        **summarise(events, fault_step=fault_step),
        "final_step": final_step,
        "total_s": total_s,
        "num_workers": num_workers,
        "ckpt_every": ckpt_every,
        "timeline": os.path.join(timeline_dir, EVENTS_FILE),
    }
    out["sanity"] = sanity_problems(out, num_steps=num_steps, fault_step=fault_step, ckpt_every=ckpt_every)
    return out


def sanity_problems(result: dict, *, num_steps: int, fault_step: int, ckpt_every: int) -> list[str]:
    """Why a Ray Train recovery result is not a fair figure to compare with (empty: it is): the run
    did not reach its last step, did not restart, resumed from somewhere a checkpoint cannot be,
    counts its lost steps wrongly, or has times that are not positive and in order. The peer's
    check, run by the benchmark on every result it reports (a test of its own took a Ray cluster
    and a minute; tests/test_bench_recovery.py checks this function)."""
    out = []
    if result.get("final_step") != num_steps:
        out.append(f"final_step {result.get('final_step')} != {num_steps}")
    if result.get("fault_step") != fault_step:
        out.append(f"fault_step {result.get('fault_step')} != {fault_step}")
    resumed = result.get("resumed_step")
    if not (isinstance(resumed, int) and 0 <= resumed <= fault_step and resumed % ckpt_every == 0):
        out.append(f"resumed_step {resumed} is not a checkpoint step at or before the fault")
    elif result.get("lost_steps") != fault_step - resumed:
        out.append(f"lost_steps {result.get('lost_steps')} != {fault_step} - {resumed}")
    if not (result.get("num_restarts") or 0) >= 1:
        out.append("no restart recorded")
    times = [result.get(k) for k in ("recover_s", "restart_s", "total_s")]
    if not all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in times):
        out.append(f"recover_s, restart_s, total_s not all positive: {times}")
    detect = result.get("detect_s")
    if detect is not None and not (0 <= detect <= (result.get("restart_s") or 0) <= (result.get("recover_s") or 0)):
        out.append(f"detect_s {detect} <= restart_s <= recover_s does not hold")
    return out
