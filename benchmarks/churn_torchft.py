"""The `ray-train-torchft` system of `python -m benchmarks churn`: Ray Train with torchft's
replica-group recovery, set up as `benchmarks/torchft_peer.py` sets it up for the recovery bench
(Ray's `torchft_linear_example.py` and torchft's documented lighthouse settings: each worker a
replica group of its own, `PGTransport` healing a replacement from a live peer, a checkpoint
reported every `CKPT_EVERY` committed steps), driven by the churn schedule instead of one fault.

Under torchft the survivors of a fault keep stepping without the lost group: a committed step
then trains on the slices of the groups present (torchft averages over them), so its
`participants` are below the full count. Such a step advances the step counter, and counts as
progress in `goodput` as elastic's steps at a smaller size do; `goodput_rank_bound` counts it as
participants / workers, as the churn bench counts elastic's steps at a smaller size.

Every worker appends one line per committed step to the run's step log ({"t", "step", "rank",
"participants"}) and one before its first ({"t", "start", "rank"}: the step it began from, which a
replacement was healed to); the driver reads them as it reads Ray Train's rank-0 log. The
lighthouse is an actor on the driver's node, so this system runs on a cluster whose head has a
CPU (`local_cluster(..., head_cpus=1)`), its workers on the worker nodes.
"""
from __future__ import annotations

import json
import os
import time


def torchft_churn_loop(config: dict) -> None:
    """Per-worker training function: one replica group of one worker, until the driver's stop step."""
    import ray.train

    from benchmarks.torchft_peer import build_replica, report_step, torchft_step
    from elastic import workload
    from elastic.data.order import GlobalOrder

    ctx = ray.train.get_context()
    rank, num_groups = ctx.get_world_rank(), ctx.get_world_size()
    manager, module, model, optimizer = build_replica(config, rank)
    dataset = workload.build_dataset()
    order = GlobalOrder(len(dataset), config["seed"])
    global_batch, stop_file = config["global_batch_size"], config["stop_file"]
    stop_at = None
    fd = os.open(config["step_log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(**fields) -> None:  # one write per line on an O_APPEND descriptor: lines never interleave
        os.write(fd, (json.dumps({"t": time.time(), "rank": rank, **fields}) + "\n").encode())

    started = False
    try:
        while stop_at is None or manager.current_step() < stop_at:
            if stop_at is None and os.path.exists(stop_file):
                with open(stop_file) as f:
                    stop_at = int(f.read() or 0)
                continue
            before = manager.current_step()
            loss = torchft_step(model, optimizer, dataset,
                                order.rank_indices(before, global_batch, num_groups, rank))
            after = manager.current_step()
            if after > before:
                if not started:  # the step it began from: a replacement's is where its peer healed it to
                    log(start=after - 1)
                    started = True
                log(step=after, participants=manager.num_participants())
                if after % config["ckpt_every"] == 0:
                    report_step(config, rank, after, float(loss.detach()), module, optimizer,
                                manager)
    finally:
        os.close(fd)
    manager.shutdown()  # as the example: a finished group must not leave the others waiting on its quorum


def torch_config():
    """torchft's config for TorchTrainer: the lighthouse with torchft's documented settings."""
    from ray.train.v2.torch.torchft_config import TorchftConfig

    from benchmarks.torchft_peer import LIGHTHOUSE_KWARGS
    return TorchftConfig(lighthouse_kwargs=dict(LIGHTHOUSE_KWARGS), backend="gloo")


def rank_bound_steps(steps: list[tuple[float, int, int]], first: int, last: int, num_workers: int) -> float:
    """Steps first < s <= last counted as participants / num_workers each (a step's participants:
    the most any worker logged for it). `steps`: (t, step, participants) from every worker. Pure."""
    most: dict[int, int] = {}
    for _, step, participants in steps:
        if first < step <= last:
            most[step] = max(most.get(step, 0), participants)
    return sum(min(p, num_workers) / num_workers for p in most.values())


def full_again(steps: list[tuple[float, int, int]], num_workers: int) -> list[float]:
    """When training was back at full size: the first full step after each stretch of steps with
    fewer participants (by step order). Pure."""
    by_step: dict[int, tuple[float, int]] = {}
    for t, step, participants in steps:
        old = by_step.get(step)
        by_step[step] = (min(t, old[0]) if old else t, max(participants, old[1] if old else 0))
    out, short = [], False
    for step in sorted(by_step):
        t, participants = by_step[step]
        if participants < num_workers:
            short = True
        elif short:
            out.append(t)
            short = False
    return out
