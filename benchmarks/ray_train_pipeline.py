"""Ray Train's side of `python -m benchmarks pipeline`'s stage loss: the plain pipeline
(`benchmarks.plain_pipeline`) in a `TorchTrainer`'s training function, with Ray Train's documented
checkpointing and `FailureConfig`, restarting the whole group from its last registered checkpoint.
"""
from __future__ import annotations

import os
import tempfile
import time
import uuid

from benchmarks.pipeline import (CKPT_EVERY, FAULT_RANK, GLOBAL_BATCH, MICROBATCHES, RECOVERY_STEPS, SEED,
                                 chunks_per_rank, split_points)

STAGE_FILE = "stage-{}.pt"


def _ray_train_loop(config: dict) -> None:
    """The per-worker training function: the plain pipeline (`plain_pipeline.build_pipeline`,
    `run_step`) with Ray Train's documented checkpointing. Every rank of replica 0 writes its
    stage's shard and reports it (Ray Train merges the workers' files into one checkpoint); the
    other replicas report metrics only. With tp (one replica) every rank writes its stage's
    tensor slices with `torch.distributed.checkpoint` (`ray_train_fsdp.save`, a collective, the
    optimizer's state by parameter name as torchtitan saves a pipeline's), as Ray Train's FSDP and
    tp peers do. A restarted group resumes from the newest checkpoint."""
    import ray.train
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks import ray_train_fsdp
    from benchmarks.plain_pipeline import build_pipeline, run_step
    from benchmarks.ray_train_peer import FAULT_MARKER, fire_fault_once, log_event
    from elastic.data.order import GlobalOrder
    from examples.gpt import build_dataset, build_model, stage_loss

    timeline_dir, pp, tp = config["timeline_dir"], config["stages"], config.get("tp", 1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    fault_marker = os.path.join(timeline_dir, FAULT_MARKER)
    is_recovery = os.path.exists(fault_marker)  # the fault fired before this attempt started

    if tp > 1:  # the plain pipeline's numbering: replica, then stage, then tp index
        if world != pp * tp:
            raise ValueError(f"the Ray Train pipeline peer runs tp with one replica only: world {world}, pp {pp}, tp {tp}")
        mesh = init_device_mesh("cpu", (1, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world // pp, pp), mesh_dim_names=("dp", "pp"))  # Ray Train's gloo group
    torch.manual_seed(config["seed"])
    me = build_pipeline(mesh, build_model(), config["split"], config["schedule"], config["microbatches"], stage_loss,
                        config["stages_per_rank"])
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            if tp > 1:
                step = ray_train_fsdp.load(me.modules[0], me.optimizer, d, ray_train_fsdp.PIPELINE)
            else:
                state = torch.load(os.path.join(d, STAGE_FILE.format(me.stage)), weights_only=True)
        if tp == 1:
            for m, sd in zip(me.modules, state["modules"]):
                getattr(m, "module", m).load_state_dict(sd)
            me.optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
    log_event(timeline_dir, "train_fn_start", rank=rank, resume_step=step, recovery=is_recovery)

    dataset = build_dataset()
    order = GlobalOrder(len(dataset), config["seed"])
    num_steps, fault_at = config["num_steps"], config["fault_step"]
    logged_first = False
    while step < num_steps:
        if rank == FAULT_RANK and step == fault_at:
            fire_fault_once(timeline_dir, rank, step, config["fault"])
        loss = run_step(me, dataset, order, step, config["global_batch"])
        step += 1
        if rank == 0 and is_recovery and not logged_first:
            log_event(timeline_dir, "first_step_after_recovery", rank=rank, step=step)
            logged_first = True
        metrics = {"step": step, "loss": float(loss) if loss is not None else None}
        if step % config["ckpt_every"] == 0:
            if me.replica == 0:
                with tempfile.TemporaryDirectory() as tmp:
                    if tp > 1:
                        ray_train_fsdp.save(me.modules[0], me.optimizer, step, tmp, rank, ray_train_fsdp.PIPELINE)
                    else:
                        torch.save({"modules": [getattr(m, "module", m).state_dict() for m in me.modules],
                                    "optimizer": me.optimizer.state_dict(), "step": step},
                                   os.path.join(tmp, STAGE_FILE.format(me.stage)))
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
                log_event(timeline_dir, "checkpoint_reported", rank=rank, step=step)
            else:
                ray.train.report(metrics)
        elif step == num_steps:
            ray.train.report(metrics)
    if rank == 0:
        log_event(timeline_dir, "train_fn_done", rank=rank, step=step)


def run_ray_train_recovery(stages: int, replicas: int, fault: str, at_step: int, schedule: str,
                           storage_dir: str, tp: int = 1) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    from benchmarks.ray_train_peer import EVENTS_FILE, TimelineCallback, log_event, read_events, summarise

    name = f"ray-train-pipeline-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:6]}"
    timeline_dir = os.path.join(storage_dir, f"{name}-timeline")
    os.makedirs(timeline_dir)
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"timeline_dir": timeline_dir, "stages": stages, "split": split_points(stages, schedule),
                           "schedule": schedule, "stages_per_rank": chunks_per_rank(schedule),
                           "microbatches": MICROBATCHES, "global_batch": GLOBAL_BATCH, "seed": SEED,
                           "num_steps": RECOVERY_STEPS, "fault_step": at_step, "fault": fault,
                           "ckpt_every": CKPT_EVERY, "tp": tp},
        scaling_config=ray.train.ScalingConfig(num_workers=stages * replicas * tp, use_gpu=False,
                                               resources_per_worker={"CPU": 1 / tp}),
        run_config=ray.train.RunConfig(storage_path=storage_dir, name=name,
                                       failure_config=ray.train.FailureConfig(max_failures=2),
                                       callbacks=[TimelineCallback(timeline_dir)]),
    )
    log_event(timeline_dir, "fit_start")
    t0 = time.time()
    result = trainer.fit()
    total_s = time.time() - t0
    events = read_events(timeline_dir)
    done = [e for e in events if e["event"] == "train_fn_done"]
    return {**summarise(events, fault_step=at_step),
            "final_step": done[-1]["step"] if done else (result.metrics or {}).get("step"),
            "total_s": total_s, "timeline": os.path.join(timeline_dir, EVENTS_FILE)}
