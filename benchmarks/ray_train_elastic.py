"""The Ray Train peer of `python -m benchmarks resize`: Ray Train's own elastic scaling.

Runs the common workload (elastic/workload.py) the way Ray Train's "Elastic
training" guide says to: `TorchTrainer`, DDP through `prepare_model`, a
checkpoint every `ckpt_every` steps written by rank 0 and reported with
`ray.train.report`, `ray.train.get_checkpoint()` to resume, and
`ScalingConfig(num_workers=(min_workers, max_workers))` -- a tuple is how Ray
Train V2 (the default in Ray 2.60; `RAY_TRAIN_V2_ENABLED=0` would select the
old V1 which has no elasticity) spells elastic scaling. The guide also asks
for `FailureConfig(max_failures)`; it is set, though no failure is injected.

Scenario: the cluster starts with exactly `min_workers` one-CPU worker nodes,
so training starts at that size. When rank 0 reaches `grow_at_step`, the
driver adds one more one-CPU node and waits until the GCS lists it. Ray Train
then notices the extra capacity and resizes: it stops the whole worker group
and starts a new, larger one, which resumes from the latest checkpoint the
controller has registered (a full restart, not an in-place resize).

How Ray Train 2.60 notices (read from its source, `ElasticScalingPolicy` and
the Ray Data `_AutoscalingCoordinatorActor` it asks for resources):
  * the coordinator refreshes its view of the cluster's nodes on a 20 s tick
    (`TICK_INTERVAL_S`, not configurable), so a new node is seen 0-20 s late;
  * while the group is healthy, the controller (polling workers every 2 s,
    `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`) considers a resize at most once per
    `ScalingConfig.elastic_resize_monitor_interval_s` (default 60 s), counted
    from the group's start or the last consideration.
Both are left at Ray's defaults unless the caller passes
`resize_monitor_interval_s` (the documented `ScalingConfig` field; None keeps
Ray's 60 s). With the defaults the run has to last for more than about a
minute after the group starts, or it finishes before Ray Train ever
considers growing; pick `num_steps` accordingly (the result says
`resized: False` when that happened). None of this enters `resize_s`, which
starts at the decision; it is all in `decide_s` and `resize_from_node_s`.

Where the decision is visible: a `ControllerCallback` (Ray Train's
DeveloperAPI controller hook interface, which `RunConfig(callbacks=...)`
accepts next to `UserCallback`s) logs every controller state change; the
transition RUNNING -> RESIZING is the resize decision.

The timeline is a JSONL file next to Ray Train's run folder that the driver,
the controller and the workers append to, with wall-clock timestamps; that
works because every node of the local cluster runs on this machine (see
`ray_train_peer`).

Caveats: the Ray Data autoscaling coordinator is a detached actor that
outlives a run and keeps a node view up to 20 s old, so give each
repetition a fresh cluster (or wait > 20 s after removing the extra node)
or the next run may start at the stale, larger size. On a machine with
fewer cores than `max_workers` the bigger group is oversubscribed; the
per-size step rates in the result show it. Observed on a 2-core machine:
rank 0's checkpointing `ray.train.report` returns in step with the
controller's 2 s poll, so with a checkpoint every 10 steps the run makes
about 5 steps/s at either size although 10 steps compute in about 0.4 s;
and the resize discards the checkpoint still in flight at the decision
(the controller had registered only the one before), so `lost_steps` is
about `ckpt_every` rather than "steps since the last checkpoint written".
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any, Callable, Union

import ray
import ray.train
from ray.train.torch import TorchTrainer

from elastic import workload
from elastic.local_cluster import LocalCluster, raylet_alive
from benchmarks.ray_train_peer import (
    EVENTS_FILE, log_event, read_events, run_storage, report_step, resume_workload, train_step)

GROW_MARKER = "grow.marker"

try:  # DeveloperAPI: the only hook that shows the controller's resize decision.
    from ray.train.v2._internal.execution.callback import ControllerCallback as _ControllerCallbackBase
except ImportError:  # pragma: no cover - other Ray versions: no decision events, only resize_from_node_s
    _ControllerCallbackBase = None


class _ReportTimeline(ray.train.UserCallback):
    """Runs in the controller: which reports (and checkpoints) Ray Train registered, and when."""

    def __init__(self, timeline_dir: str):
        self.timeline_dir = timeline_dir

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        log_event(self.timeline_dir, "controller_registered_report",
                   step=metrics[0].get("step"), checkpoint=checkpoint is not None)

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        log_event(self.timeline_dir, "controller_saw_failure",
                   errors={rank: f"{type(e).__name__}: {str(e)[:200]}" for rank, e in worker_exceptions.items()})


if _ControllerCallbackBase is not None:
    class _ControllerTimeline(_ControllerCallbackBase):
        """Runs in the controller: every state change, and the resize decisions it executes."""

        def __init__(self, timeline_dir: str):
            self.timeline_dir = timeline_dir

        def after_controller_state_update(self, previous_state, current_state) -> None:
            if type(previous_state) is type(current_state):
                return  # RUNNING -> RUNNING on every 2 s poll
            decision = getattr(current_state, "scaling_decision", None)
            log_event(self.timeline_dir, "controller_state",
                       previous=type(previous_state).__name__, current=type(current_state).__name__,
                       num_workers=getattr(decision, "num_workers", None))

        def before_controller_execute_resize_decision(self, resize_decision) -> None:
            log_event(self.timeline_dir, "controller_execute_resize", num_workers=resize_decision.num_workers)


def _train_loop(config: dict) -> None:
    """The per-worker training function (runs in each Ray Train worker process)."""
    timeline_dir = config["timeline_dir"]
    num_steps, grow_at_step, ckpt_every = config["num_steps"], config["grow_at_step"], config["ckpt_every"]
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    global_batch = config["global_batch_size"]
    per_rank_batch = global_batch // world_size

    model, optimizer, step, checkpoint, _ = resume_workload(config["seed"])
    log_event(timeline_dir, "train_fn_start", rank=rank, world_size=world_size, resume_step=step,
               checkpoint=checkpoint.path if checkpoint is not None else None)

    dataset = workload.build_dataset()

    while step < num_steps:
        loss = train_step(model, optimizer, dataset, step, global_batch, rank, per_rank_batch)
        step += 1
        if rank == 0:
            log_event(timeline_dir, "step", step=step, world_size=world_size)
            if step >= grow_at_step:
                # Tells the driver to add the node; O_EXCL: once per run, whatever restarts follow.
                try:
                    os.close(os.open(os.path.join(timeline_dir, GROW_MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass

        metrics = {"step": step, "loss": float(loss.detach()), "world_size": world_size}
        report_step(model, optimizer, step, metrics, rank, ckpt_every, num_steps, timeline_dir, world_size=world_size)
    if rank == 0:
        log_event(timeline_dir, "train_fn_done", rank=rank, step=step, world_size=world_size)


def _steps_per_s(steps: list[dict]) -> float | None:
    """Rank 0's step rate over a run of consecutive step events (None if too few)."""
    if len(steps) < 2 or steps[-1]["t"] <= steps[0]["t"]:
        return None
    return (len(steps) - 1) / (steps[-1]["t"] - steps[0]["t"])


def _summarise(events: list[dict]) -> dict:
    """Turn the timeline into the benchmark's figures (None where an event never happened)."""
    starts = [e for e in events if e["event"] == "train_fn_start" and e["rank"] == 0]
    world_sizes_seen: list[int] = []
    for e in starts:
        if not world_sizes_seen or world_sizes_seen[-1] != e["world_size"]:
            world_sizes_seen.append(e["world_size"])
    old_size = starts[0]["world_size"] if starts else None

    added = next((e for e in events if e["event"] == "node_added"), None)
    add_started = next((e for e in events if e["event"] == "node_add_start"), None)
    t_added = added["t"] if added is not None else float("inf")
    # The decision: the controller goes RUNNING -> RESIZING towards a larger
    # group, after the node was there to be found.
    decision = next((e for e in events
                     if e["event"] == "controller_state" and e["current"] == "ResizingState"
                     and e["t"] >= t_added and (e.get("num_workers") or 0) > (old_size or 0)), None)
    new_start = next((e for e in starts if old_size is not None and e["world_size"] > old_size and e["t"] >= t_added),
                     None)
    new_size = new_start["world_size"] if new_start is not None else None
    first_new_step = (next((e for e in events if e["event"] == "step" and e["world_size"] == new_size
                            and e["t"] >= new_start["t"]), None) if new_start is not None else None)

    t_switch = new_start["t"] if new_start is not None else float("inf")
    old_steps = [e for e in events if e["event"] == "step" and e["world_size"] == old_size and e["t"] < t_switch]
    new_steps = [e for e in events if e["event"] == "step" and e["world_size"] == new_size and e["t"] >= t_switch]
    last_old_step = max((e["step"] for e in old_steps), default=None)
    resumed_step = new_start["resume_step"] if new_start is not None else None

    def between(a: dict | None, b: dict | None) -> float | None:
        return b["t"] - a["t"] if a is not None and b is not None else None

    return {
        "resized": new_start is not None,
        # The BENCHMARKS.md figure: resize decided -> first step at the new size.
        "resize_s": between(decision, first_new_step),
        # Node registered with the GCS -> first step at the new size: includes
        # Ray Train's polling (coordinator tick + monitor interval).
        "resize_from_node_s": between(added, first_new_step),
        "decide_s": between(added, decision),  # node registered -> decision (polling only)
        "restart_s": between(decision, new_start),  # decision -> new group's rank 0 in the train fn, checkpoint loaded
        "node_start_s": between(add_started, added),  # add_node() -> node listed alive by the GCS
        "lost_steps": last_old_step - resumed_step if last_old_step is not None and resumed_step is not None else None,
        "last_old_step": last_old_step,
        "resumed_step": resumed_step,
        "world_sizes_seen": world_sizes_seen,
        "old_world_size": old_size,
        "new_world_size": new_size,
        "node_added_at_step": max((e["step"] for e in events if e["event"] == "step" and e["t"] <= t_added),
                                  default=None) if added is not None else None,
        "steps_per_s_old": _steps_per_s(old_steps),
        "steps_per_s_new": _steps_per_s(new_steps),
        "decision_visible": decision is not None,
        "num_group_starts": len(starts),
        "controller_failures": sum(1 for e in events if e["event"] == "controller_saw_failure"),
    }


def _node_adder(cluster: Union[LocalCluster, Callable[[], Any]]) -> Callable[[], None]:
    """A callable that adds one worker node and returns once the GCS lists it with its CPUs."""
    if isinstance(cluster, LocalCluster):
        def add() -> None:
            running = sum(1 for n in cluster.cluster.worker_nodes if raylet_alive(n))
            cluster.ensure_worker_nodes(running + 1)  # adds one node, waits until it is registered
        return add
    if callable(cluster):
        return cluster
    raise TypeError(f"cluster must be a LocalCluster or a callable that adds one node, got {type(cluster).__name__}")


def _worker_cpus() -> float:
    return sum(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"])


def run_ray_train_resize(
    storage_dir: str,
    *,
    num_steps: int,
    grow_at_step: int,
    ckpt_every: int = 10,
    cluster: Union[LocalCluster, Callable[[], Any]],
    min_workers: int = 2,
    max_workers: int = 3,
    global_batch_size: int = 96,
    seed: int = 0,
    resize_monitor_interval_s: float | None = None,
    max_failures: int = 3,
    checkpoints_to_keep: int = 2,
    s3=None,
) -> dict:
    """Train the common workload with Ray Train elastic scaling; add a node at `grow_at_step`; measure the resize.

    Needs `ray.init` done on a cluster whose worker CPUs allow exactly
    `min_workers` one-CPU workers (so training starts at that size).
    `cluster` is what adds the node: the `LocalCluster` the caller owns, or
    any zero-argument callable that adds one worker node and returns once it
    is registered; it is called from the calling thread, which must be the
    main thread for `LocalCluster` (Ray's `Cluster.add_node` sets signal
    handlers), while `trainer.fit()` runs in a helper thread.
    `resize_monitor_interval_s` sets
    `ScalingConfig.elastic_resize_monitor_interval_s`; None keeps Ray's
    default (60 s). Old checkpoints are pruned to `checkpoints_to_keep`
    (`CheckpointConfig.num_to_keep`) so long runs don't fill the disk. `s3` (an
    `tests.support.seaweedfs.S3Server`): checkpoints go to that S3 endpoint (see
    `benchmarks.ray_train_peer.run_storage`), else to `storage_dir`.

    Returns one benchmark record (see docs/benchmarks/resize.md): `resize_s`
    (decision -> first step at the new size), `resize_from_node_s` (node
    registered -> same), `lost_steps`, `world_sizes_seen`, and the parts in
    between.
    """
    if not 1 <= min_workers < max_workers:
        raise ValueError(f"need 1 <= min_workers < max_workers, got ({min_workers}, {max_workers})")
    if not 0 < grow_at_step < num_steps:
        raise ValueError(f"grow_at_step must be in (0, num_steps={num_steps}), got {grow_at_step}")
    if ckpt_every < 1:
        raise ValueError(f"ckpt_every must be >= 1, got {ckpt_every}")
    for n in range(min_workers, max_workers + 1):
        if global_batch_size % n:
            raise ValueError(f"global_batch_size ({global_batch_size}) must be divisible by every size in "
                             f"[{min_workers}, {max_workers}], not by {n}")
    if resize_monitor_interval_s is not None and resize_monitor_interval_s < 0:
        raise ValueError(f"resize_monitor_interval_s must be >= 0, got {resize_monitor_interval_s}")
    from ray.train.v2._internal.constants import is_v2_enabled
    if not is_v2_enabled():
        raise RuntimeError("Ray Train elastic scaling needs Train V2; unset RAY_TRAIN_V2_ENABLED=0")
    if not ray.is_initialized():
        raise RuntimeError("run_ray_train_resize needs a connected Ray cluster (see elastic.local_cluster)")
    cpus = _worker_cpus()
    if int(cpus) != min_workers:
        raise RuntimeError(f"the cluster has {cpus:g} CPUs; it must start with exactly min_workers={min_workers} "
                           "(one per one-CPU worker node) so that training starts small and can grow")
    add_node = _node_adder(cluster)

    storage_dir = os.path.abspath(storage_dir)
    name = f"ray-train-resize-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    timeline_dir = os.path.join(storage_dir, f"{name}-timeline")  # next to, not inside, Ray Train's run folder
    os.makedirs(timeline_dir)

    scaling_kwargs: dict[str, Any] = {}
    if resize_monitor_interval_s is not None:
        scaling_kwargs["elastic_resize_monitor_interval_s"] = resize_monitor_interval_s
    scaling_config = ray.train.ScalingConfig(
        num_workers=(min_workers, max_workers), use_gpu=False, resources_per_worker={"CPU": 1}, **scaling_kwargs)
    callbacks: list = [_ReportTimeline(timeline_dir)]
    if _ControllerCallbackBase is not None:
        callbacks.append(_ControllerTimeline(timeline_dir))
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={
            "timeline_dir": timeline_dir, "num_steps": num_steps, "grow_at_step": grow_at_step,
            "ckpt_every": ckpt_every, "global_batch_size": global_batch_size, "seed": seed,
        },
        scaling_config=scaling_config,
        run_config=ray.train.RunConfig(
            **run_storage(storage_dir, s3),
            name=name,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=checkpoints_to_keep),
            callbacks=callbacks,
        ),
    )

    # fit() runs in a driver thread (Ray Train supports that: it is how Tune
    # calls it) because the node must be added from the main thread:
    # `ray.cluster_utils.Cluster.add_node` installs signal handlers.
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread below
            outcome["error"] = e

    fitter = threading.Thread(target=fit, name="ray-train-resize-fit", daemon=True)
    log_event(timeline_dir, "fit_start")
    t0 = time.time()
    fitter.start()
    grow_error = None
    marker = os.path.join(timeline_dir, GROW_MARKER)
    while fitter.is_alive() and not os.path.exists(marker):
        fitter.join(0.05)
    if os.path.exists(marker) and fitter.is_alive():  # no point growing a finished run
        log_event(timeline_dir, "node_add_start")
        try:
            add_node()
        except Exception as e:  # noqa: BLE001 - reported in the result; the run goes on at the old size
            grow_error = f"{type(e).__name__}: {e}"
        else:
            log_event(timeline_dir, "node_added", worker_cpus=_worker_cpus())
    fitter.join()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    total_s = time.time() - t0
    log_event(timeline_dir, "fit_done")

    events = read_events(timeline_dir)
    done = [e for e in events if e["event"] == "train_fn_done"]
    return {
        "bench": "resize",
        "system": "ray-train",
        **_summarise(events),
        "final_step": (result.metrics or {}).get("step", done[-1]["step"] if done else None),
        "num_steps": num_steps,
        "grow_at_step": grow_at_step,
        "ckpt_every": ckpt_every,
        "min_workers": min_workers,
        "max_workers": max_workers,
        "elastic_resize_monitor_interval_s": scaling_config.elastic_resize_monitor_interval_s,
        "grow_error": grow_error,
        "total_s": total_s,
        "timeline": os.path.join(timeline_dir, EVENTS_FILE),
    }
