"""What the cluster's nodes can hold, asked of Ray: before any worker starts, whether the in-memory
copies of state held once fit each node's memory budget (checkpoint.memory_max_host_share); while
the group runs, each node's free CPUs (where a worker can start now), and where an actor still
waiting for a worker waits."""
from __future__ import annotations

import ray

from elastic.config import ConfigError, JobConfig
from elastic.parallel.shape import shape_for
from elastic.parallel.topology import chain
from elastic.policies.buddies import NodeRoom, copies_room, has_copies


def copies_world(job: JobConfig) -> int | None:
    """The smallest world size at which the run takes in-memory copies (a rank's share is largest
    there); None when it never takes any (copies off, or replicated state at every layout)."""
    shape = shape_for(job)
    every = job.checkpoint.memory_every_steps
    sizes = [lay.world_size for lay in chain(shape.layout(job.scaling.max_size), job.scaling.min_size)
             if has_copies(every, shape.sharded, lay.pp, lay.dp, lay.tp, lay.shards)]
    if not shape.staged and has_copies(every, shape.sharded, 1, job.scaling.min_size, 1):
        sizes.append(job.scaling.min_size)  # flat: any size down to min_workers
    return min(sizes) if sizes else None


def node_rooms(job: JobConfig) -> list[NodeRoom]:
    """Every alive node that can hold a rank, as Ray sees it now."""
    sc = job.scaling
    out = []
    for n in ray.nodes():
        res = n.get("Resources", {})
        if not n.get("Alive") or "memory" not in res:
            continue
        slots = res.get("GPU", 0) if sc.use_gpu else res.get("CPU", 0) / sc.cpus_per_worker
        if int(slots) >= 1:
            out.append(NodeRoom(n.get("NodeName", "?") + "/" + n["NodeID"][:8], int(slots), res["memory"]))
    return out


def check_copies_room(job: JobConfig, model_fn, make_opt=None) -> None:
    """Raise ConfigError, naming the fields, when the copies would pass the memory budget on some
    node that is up now. The state is measured only for a job that takes copies. No estimate (a
    model that cannot be built on meta) or no node yet (an autoscaler adds them): no check."""
    world = copies_world(job)
    if world is None:
        return
    from elastic.parallel.memory import state_bytes
    from elastic.runtime.state import default_optimizer
    size = state_bytes(model_fn, make_opt or default_optimizer)
    if not size:
        return
    why = copies_room(size / world, world, node_rooms(job), job.checkpoint.memory_max_host_share)
    if why:
        raise ConfigError(f"checkpoint.memory_max_host_share={job.checkpoint.memory_max_host_share:g}: {why}. Set "
                          f"checkpoint.memory_every_steps: 0 (faults restore from storage), raise "
                          f"memory_max_host_share, or spread the ranks over more nodes")


def free_cpus_by_node() -> dict[str, float]:
    """Each alive node's CPUs that no task or actor holds now (the head included)."""
    out: dict[str, float] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            out[node["NodeID"]] = 0.0
    for node_id, res in _available_by_node().items():
        if node_id in out:
            out[node_id] = res.get("CPU", 0.0)
    return out


def _available_by_node() -> dict[str, dict]:
    # Ray has no public per-node view of available resources (ray.available_resources() sums
    # the cluster); this is what `ray status` reads.
    return ray._private.state.available_resources_per_node()


def placing_node(handle) -> str | None:
    """The node (hex id) where a Ray actor is placed: the node it runs on, or, while it waits for
    a worker, the node whose raylet holds its request (the GCS ties a pending actor to the node
    it leases from, and a request for a slot no node has free waits there). None when Ray cannot
    say: the GCS does not know the actor, or this Ray has no such table."""
    try:
        info = ray._private.state.state.actor_table(handle._actor_id.hex())
    except Exception:  # noqa: BLE001 - a private table: without it, nothing is restarted
        return None
    node = ((info or {}).get("Address") or {}).get("NodeID") or ""
    return node if node.strip("f0") else None
