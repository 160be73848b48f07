"""The Ray Train systems of `python -m benchmarks churn` (benchmarks/churn.py): `ray-train`
(`FailureConfig(max_failures=100000)`, a checkpoint reported every `CKPT_EVERY` steps, as
`benchmarks/ray_train_peer.py` trains), `ray-train-elastic` (its elastic scaling) and
`ray-train-torchft` (torchft's replica groups, benchmarks/churn_torchft.py), driven through the
same fault schedule and sampled from a step log the workers write."""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
import uuid

from benchmarks.churn import (CKPT_EVERY, GLOBAL_BATCH, NUM_WORKERS, RAY_TRAIN_ELASTIC_MONITOR_S, TRAINING_TITLES,
                              ChurnInjector, Fault, Phases, per_fault)


def _ray_train_loop(config: dict) -> None:
    """The per-worker function: ray_train_peer's documented pattern (prepare_model, a checkpoint
    every CKPT_EVERY steps via ray.train.report, resume from ray.train.get_checkpoint()), plus a
    step log written by rank 0 and a stop step the driver sets at the window's end."""
    import ray.train

    from elastic import workload
    from benchmarks.ray_train_peer import report_step, resume_workload, train_step

    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    per_rank_batch = config["global_batch_size"] // world_size
    model, optimizer, step, _, _ = resume_workload(config["seed"])
    dataset = workload.build_dataset()
    stop_file, num_steps = config["stop_file"], config["num_steps"]
    stop_at = None
    fd = os.open(config["step_log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if rank == 0 else None
    try:
        if fd is not None:
            os.write(fd, (json.dumps({"t": time.time(), "start": step}) + "\n").encode())
        while step < min(num_steps, stop_at or num_steps):
            if stop_at is None and os.path.exists(stop_file):
                with open(stop_file) as f:
                    stop_at = int(f.read() or 0)
                if step >= stop_at:
                    break
            loss = train_step(model, optimizer, dataset, step, config["global_batch_size"], rank, per_rank_batch)
            step += 1
            if fd is not None:
                os.write(fd, (json.dumps({"t": time.time(), "step": step}) + "\n").encode())
            report_step(model, optimizer, step, {"step": step, "loss": float(loss.detach())}, rank,
                        config["ckpt_every"], num_steps, config["timeline_dir"])
    finally:
        if fd is not None:
            os.close(fd)


def _remove_placement_groups() -> None:
    """Remove every placement group still in the cluster (between systems, none should be)."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group
    for pg_id, info in ray.util.placement_group_table().items():
        if info.get("state") != "REMOVED":
            with contextlib.suppress(Exception):
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def _kill_ray_train_controller(cluster) -> None:
    """At the end of a run: SIGKILL Ray Train's controller actor (on the head), if still there."""
    import psutil
    from ray._private import ray_constants
    for info in cluster.cluster.head_node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(info.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if " ".join(p.cmdline()).startswith("ray::TrainController"):
                        p.kill()


def run_ray_train(cluster, work: str, schedule: list[Fault], args, system: str = "ray-train"
                  ) -> tuple[dict, ChurnInjector]:
    """Ray Train (`ray-train`), with its elastic scaling (`ray-train-elastic`) or with torchft
    (`ray-train-torchft`, benchmarks/churn_torchft.py: every worker logs its steps)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from benchmarks import churn_torchft
    elastic, torchft = system == "ray-train-elastic", system == "ray-train-torchft"

    name = f"ray-train-churn-{uuid.uuid4().hex[:8]}"
    timeline_dir = os.path.join(work, f"{name}-timeline")
    os.makedirs(timeline_dir)
    step_log, stop_file = os.path.join(timeline_dir, "steps.jsonl"), os.path.join(timeline_dir, "stop")
    read_at = [0]
    high = [0]
    starts: list[dict] = []
    timeline: list[tuple[float, int]] = []  # (t, step) of every step rank 0 (torchft: every worker) logged
    sized: list[tuple[float, int, int]] = []  # torchft: (t, step, participants) of every step logged

    def get_step() -> int:
        with contextlib.suppress(FileNotFoundError):
            with open(step_log) as f:
                f.seek(read_at[0])
                chunk = f.read()
            whole = chunk[: chunk.rfind("\n") + 1]
            read_at[0] += len(whole.encode())
            for line in whole.splitlines():
                e = json.loads(line)
                if "step" in e:
                    high[0] = max(high[0], e["step"])
                    timeline.append((e["t"], e["step"]))
                    if "participants" in e:
                        sized.append((e["t"], e["step"], e["participants"]))
                    if starts and "first_step_t" not in starts[-1]:
                        starts[-1]["first_step_t"] = e["t"]
                else:
                    starts.append(e)
        return high[0]

    fit_done = threading.Event()
    fit_error: list[str] = []
    injector = ChurnInjector(cluster, schedule, TRAINING_TITLES[system], args.replace_after_s, args.seed_used)
    phases = Phases(get_step, fit_done.is_set, args.fault_free_s, args.duration_s, injector)
    resources = {"CPU": 1, cluster.worker_node_resource: 1} if torchft else {"CPU": 1}  # the head's CPU: the lighthouse's
    trainer = TorchTrainer(
        churn_torchft.torchft_churn_loop if torchft else _ray_train_loop,
        train_loop_config={"timeline_dir": timeline_dir, "step_log": step_log, "stop_file": stop_file,
                           "num_steps": 10_000_000, "ckpt_every": CKPT_EVERY, "global_batch_size": GLOBAL_BATCH,
                           "seed": 0},
        scaling_config=ray.train.ScalingConfig(
            num_workers=(NUM_WORKERS - 1, NUM_WORKERS) if elastic else NUM_WORKERS, use_gpu=False,
            resources_per_worker=resources,
            **({"elastic_resize_monitor_interval_s": RAY_TRAIN_ELASTIC_MONITOR_S} if elastic else {})),
        run_config=ray.train.RunConfig(storage_path=work, name=name,
                                       failure_config=ray.train.FailureConfig(max_failures=100_000)),
        **({"torch_config": churn_torchft.torch_config()} if torchft else {}),
    )

    def fit() -> None:  # in a thread: the driver's main thread keeps the clock and starts nodes
        try:
            trainer.fit()
        except Exception as e:  # noqa: BLE001 - report it with the figures measured so far
            fit_error.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
        finally:
            fit_done.set()

    fitter = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    fitter.start()
    try:
        phases.run()
    finally:
        injector.stop()
        # Every rank stops at the same step, comfortably ahead of where rank 0 is now.
        with open(stop_file + ".tmp", "w") as f:
            f.write(str(get_step() + 3 * CKPT_EVERY))
        os.replace(stop_file + ".tmp", stop_file)
        # A group waiting for capacity (frozen nodes still count as alive) gets it now.
        cluster.ensure_worker_nodes(NUM_WORKERS + 1)
        fitter.join(180)
        hung = fitter.is_alive()
        # A run that hung, or failed, leaves its controller actor and its workers' placement group
        # holding every worker node's CPU: the next system could then place nothing (seen: every
        # system after one failed Ray Train run stayed at step 0).
        _kill_ray_train_controller(cluster)
        _remove_placement_groups()
        if hung:
            fit_error.append("did not stop within 180 s after the window; its controller was killed")
            fitter.join(60)
    error = fit_error[0] if fit_error else None
    get_step()
    t_churn = phases.marks.get("churn_start", (math.inf, 0))[0]
    t_end = phases.marks.get("churn_end", (math.inf, 0))[0]
    figs = phases.figures()
    if "fault_free_start" in phases.marks and "fault_free_steps_per_s" in figs:
        # Ray Train's steps come in bursts (every CKPT_EVERY-th step blocks on its checkpoint report), so
        # a sampled window is off by up to a burst: take the rate over whole checkpoint cycles in the
        # fault-free window from rank 0's per-step log instead.
        t_ff = phases.marks["fault_free_start"][0]
        cyc = [(t, st) for t, st in timeline if t_ff <= t <= t_churn and st % CKPT_EVERY == 0]
        if len(cyc) >= 2 and cyc[-1][1] > cyc[0][1]:
            figs["fault_free_steps_per_s_sampled"] = figs["fault_free_steps_per_s"]
            figs["fault_free_steps_per_s"] = (cyc[-1][1] - cyc[0][1]) / (cyc[-1][0] - cyc[0][0])
            if figs.get("steps_per_s") is not None:
                figs["goodput"] = figs["steps_per_s"] / figs["fault_free_steps_per_s"]
    # A restart = the train function starting again (rank 0's log), inside the window.
    # Back to training: a restarted function's first step; under torchft, whose survivors go on
    # without the lost group, the first step with every group again.
    back = (churn_torchft.full_again(sized, NUM_WORKERS) if torchft
            else [e["first_step_t"] for e in starts[1:] if "first_step_t" in e])
    out = {**figs, "restarts": sum(1 for e in starts if t_churn <= e["t"] <= t_end),
           "restart_resume_steps": [e["start"] for e in starts if t_churn <= e["t"] <= t_end],
           "per_fault": per_fault(injector.records, injector.t0 or 0.0, [], back),
           "timeline": timeline_dir}
    if torchft and "churn_end" in phases.marks and figs.get("fault_free_steps_per_s"):
        counted = churn_torchft.rank_bound_steps(sized, phases.marks["churn_start"][1], phases.marks["churn_end"][1],
                                                 NUM_WORKERS)
        out.update(rank_bound_steps=counted,
                   goodput_rank_bound=counted / figs["window_s"] / figs["fault_free_steps_per_s"])
    if phases.error or error:
        out["error"] = "; ".join(x for x in (phases.error, error) if x)
    return out, injector
