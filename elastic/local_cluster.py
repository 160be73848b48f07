"""A multi-node Ray cluster on one machine, for benchmarks and chaos tests.

Owns the lifetime of a `ray.cluster_utils.Cluster`: a head node with no CPUs
(so no training worker ever lands on it, and killing a worker node never takes
the GCS or the driver with it) plus `num_worker_nodes` nodes of
`cpus_per_node` CPUs each. Faults from `elastic.runtime.chaos.kill_own_node` kill a
node behind Ray's back; `ensure_worker_nodes` tops the cluster up again and
shutdown copes with the corpses.

With `head_cpus > 0` (for a peer whose own actors must sit on the driver's
node and need a CPU there, e.g. torchft's lighthouse under Ray Train) the head
gets that many CPUs and every worker node also carries the custom resource
`WORKER_NODE_RESOURCE` (one unit per CPU): training workers that request it
still never land on the head. The default (`head_cpus=0`) is unchanged.

Ray's health-check settings (GCS pings each raylet every 3 s and declares it
dead after 5 missed pings) are left at Ray's defaults on purpose: the recovery
benchmarks must measure what a user's cluster does, and node-death detection
time is part of that figure.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Iterator

import psutil
import ray
from ray._private import ray_constants
from ray.cluster_utils import Cluster

from elastic.group.room import free_cpus_by_node

logger = logging.getLogger(__name__)
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[local_cluster] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

# Node start on a loaded 2-core machine takes a few seconds; GCS registration
# of many nodes at once can take longer.
NODE_REGISTER_TIMEOUT_S = 120.0
# Custom resource on worker nodes when the head has CPUs: request it to stay off the head.
WORKER_NODE_RESOURCE = "elastic_worker_node"
# Between tests: Ray's health checks declare a killed node dead within ~15-30 s; a run's actors
# give their CPUs back within seconds of its end.
QUIET_TIMEOUT_S = 90.0


def raylet_alive(node: "ray._private.node.Node") -> bool:
    """Whether this node's raylet process (a child of ours) is still running.

    The local process handle knows at once; the GCS only learns of a killed
    raylet after its health checks time out, which is what we don't want to
    wait for when counting usable nodes.
    """
    infos = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
    return bool(infos) and all(info.process.poll() is None and not _stopped(info.process.pid) for info in infos)


def _stopped(pid: int) -> bool:
    """A frozen node (chaos freeze_node): its raylet exists but is SIGSTOPped."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


class LocalCluster:
    """Handle on a running local cluster; build it with `local_cluster()`."""

    def __init__(self, cluster: Cluster, cpus_per_node: int, head_cpus: int = 0, gpus_per_node: int = 0):
        self.cluster = cluster
        self.cpus_per_node = cpus_per_node
        self.head_cpus = head_cpus
        self.gpus_per_node = gpus_per_node

    @property
    def worker_node_resource(self) -> str | None:
        """The custom resource only worker nodes carry (None when the head has no CPUs: then
        asking for a CPU is enough to stay off it)."""
        return WORKER_NODE_RESOURCE if self.head_cpus > 0 else None

    def _add_worker_node(self) -> "ray._private.node.Node":
        extra = {"resources": {WORKER_NODE_RESOURCE: self.cpus_per_node}} if self.head_cpus > 0 else {}
        return self.cluster.add_node(num_cpus=self.cpus_per_node, num_gpus=self.gpus_per_node, **extra)

    @property
    def address(self) -> str:
        return self.cluster.address

    def alive_worker_nodes(self) -> list[dict]:
        """Nodes the GCS considers alive that have CPUs, the head excluded, as `ray.nodes()` entries."""
        head_id = self.cluster.head_node.node_id if self.cluster.head_node is not None else None
        return [n for n in ray.nodes()
                if n["Alive"] and n["Resources"].get("CPU", 0) > 0 and n["NodeID"] != head_id]

    def ensure_worker_nodes(self, num_nodes: int, timeout_s: float = NODE_REGISTER_TIMEOUT_S) -> None:
        """Top the cluster up to `num_nodes` running worker nodes after faults.

        Nodes whose raylet died are dropped from the Cluster's bookkeeping (and
        their leftover processes, e.g. the reaper, stopped) so that a later
        shutdown does not trip over them. Returns once every running node is
        registered with the GCS and shows its CPUs. The GCS may still list a
        killed node as alive for a while (until its health checks fail); such
        a node is not counted, since it can never run anything again.
        """
        for node in list(self.cluster.worker_nodes):
            if not raylet_alive(node):
                self._drop_node(node)
        running = [n for n in self.cluster.worker_nodes if raylet_alive(n)]
        for _ in range(num_nodes - len(running)):
            self._add_worker_node()
            logger.info("added a worker node (%d running)", len(self.cluster.worker_nodes))
        self._wait_registered(timeout_s)

    def wait_quiet(self, timeout_s: float = QUIET_TIMEOUT_S) -> float:
        """Wait until the cluster is as a new run should find it, and return the seconds waited:
        the GCS lists no worker node whose raylet is gone (one killed by the last run is declared
        dead only after its health checks, ~15 s) and no actor holds a CPU on a running node (the
        last run's workers and spares give theirs back as their processes exit). A run's placement
        reads both: started earlier, it may put a tp group on a node about to be declared dead, or
        split one for want of CPUs that are only late to be freed. Between tests, not mid-run."""
        t0 = time.monotonic()
        while True:
            running = {n.node_id for n in self.cluster.worker_nodes if raylet_alive(n)}
            listed = {n["NodeID"] for n in self.alive_worker_nodes()}
            free = free_cpus_by_node()
            held = sorted(n[:8] for n in running if free.get(n, 0.0) < self.cpus_per_node)
            stale = sorted(n[:8] for n in listed - running)
            waited = time.monotonic() - t0
            if not held and not stale and running <= listed:
                if waited > 1.0:
                    logger.info("waited %.1f s for the last run's CPUs and dead nodes to clear", waited)
                return waited
            if waited > timeout_s:
                raise TimeoutError(f"cluster not quiet after {timeout_s:.0f} s: CPUs still held on nodes {held}, "
                                   f"nodes gone but listed alive {stale}")
            time.sleep(0.2)

    def _wait_registered(self, timeout_s: float) -> None:
        wanted = {n.node_id for n in self.cluster.worker_nodes}
        deadline = time.monotonic() + timeout_s
        while True:
            alive = {n["NodeID"] for n in self.alive_worker_nodes()}
            if wanted <= alive:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(wanted - alive)} of {len(wanted)} worker nodes not registered with CPUs after {timeout_s} s"
                )
            time.sleep(0.2)

    def _drop_node(self, node: "ray._private.node.Node") -> None:
        """Forget a dead (or frozen) node, stopping whatever of it still runs. The raylet's
        children (workers, agents) go first: a frozen one would otherwise stay stopped forever."""
        for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(info.process.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
        try:
            # No graceful period: the raylet is gone, nothing left listens for SIGTERM.
            self.cluster.remove_node(node, allow_graceful=False)
        except Exception as e:  # noqa: BLE001 - a half-dead node may fail in many ways; we clean up below
            logger.info("remove_node(%s) failed (%s: %s); killing its leftovers", node.node_id[:8], type(e).__name__, e)
            for _, proc in node.live_processes():
                with contextlib.suppress(Exception):
                    proc.kill()
                    proc.wait(timeout=5)
            self.cluster.worker_nodes.discard(node)

    # ---- for benchmarks that fault nodes from the outside (python -m benchmarks churn); each acts on one node
    @staticmethod
    def raylet_pid(node: "ray._private.node.Node") -> int | None:
        """The pid of this node's raylet, or None if it has none (any more)."""
        infos = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
        return infos[0].process.pid if infos else None

    @staticmethod
    def node_usable(node: "ray._private.node.Node") -> bool:
        """Its raylet runs and is not frozen: the node can still host work."""
        return raylet_alive(node)

    def kill_node(self, node: "ray._private.node.Node") -> None:
        """A lost machine: SIGKILL every process under the node's raylet, then the raylet
        (what `elastic.runtime.chaos.kill_own_node` does from inside). Bookkeeping is left to
        `ensure_worker_nodes`/shutdown, which drop dead nodes."""
        pid = self.raylet_pid(node)
        if pid is None:
            return
        with contextlib.suppress(psutil.Error):
            raylet = psutil.Process(pid)
            for child in raylet.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            raylet.kill()

    def freeze_node(self, node: "ray._private.node.Node") -> None:
        """A machine that stops (power loss, kernel panic): SIGSTOP the raylet and every process
        under it. Nothing exits, no socket closes. Never thawed here; `ensure_worker_nodes` and
        shutdown treat it as not running and kill it when they drop it."""
        pid = self.raylet_pid(node)
        if pid is None:
            return
        with contextlib.suppress(psutil.Error):
            raylet = psutil.Process(pid)
            raylet.suspend()  # first, so it starts nothing new while its children are stopped
            for child in raylet.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.suspend()

    def add_worker_node(self, timeout_s: float = NODE_REGISTER_TIMEOUT_S) -> "ray._private.node.Node":
        """Add one worker node (a replacement machine) and wait until the GCS shows its CPUs.
        Unlike `ensure_worker_nodes` it leaves lost nodes alone: a frozen one stays frozen."""
        node = self._add_worker_node()
        deadline = time.monotonic() + timeout_s
        while node.node_id not in {n["NodeID"] for n in self.alive_worker_nodes()}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker node {node.node_id[:8]} not registered with CPUs after {timeout_s} s")
            time.sleep(0.2)
        logger.info("added a worker node %s (%d in the cluster's books)", node.node_id[:8],
                    len(self.cluster.worker_nodes))
        return node

    def shutdown(self) -> None:
        """Disconnect, then stop every node; tolerates nodes killed behind Ray's back."""
        try:
            ray.shutdown()
        except Exception as e:  # noqa: BLE001 - keep going: the nodes must be stopped regardless
            logger.info("ray.shutdown() failed: %s: %s", type(e).__name__, e)
        for node in list(self.cluster.worker_nodes):
            self._drop_node(node)
        gcs_address = getattr(self.cluster, "gcs_address", None)
        try:
            # Only the head is left: this stops it and resets the driver-side globals.
            self.cluster.shutdown()
        except Exception as e:  # noqa: BLE001
            logger.info("stopping the head failed (%s: %s); killing its processes", type(e).__name__, e)
            head = self.cluster.head_node
            if head is not None:
                for _, proc in head.live_processes():
                    with contextlib.suppress(Exception):
                        proc.kill()
                        proc.wait(timeout=5)
        forget_ray_address(gcs_address)


def forget_ray_address(gcs_address: str | None) -> None:
    """Remove Ray's record of the last local cluster (its temp dir's address file) if it names
    this one, now stopped. `ray.cluster_utils.Cluster` writes it and never removes it, and a
    plain `ray.init()` afterwards (an elastic job on this machine, say) would try to join the
    dead cluster for minutes."""
    try:
        from ray._private.utils import get_ray_address_file, read_ray_address
        if gcs_address and read_ray_address() == gcs_address:
            os.remove(get_ray_address_file(None))
    except Exception as e:  # noqa: BLE001 - housekeeping only
        logger.info("could not remove Ray's address file: %s: %s", type(e).__name__, e)


@contextlib.contextmanager
def local_cluster(num_worker_nodes: int = 4, cpus_per_node: int = 1, head_cpus: int = 0,
                  gpus_per_node: int = 0, dashboard: bool = True) -> Iterator[LocalCluster]:
    """Start a head (`head_cpus` CPUs, 0 by default, never a GPU) and `num_worker_nodes` worker nodes
    of `gpus_per_node` GPUs each (0 by default), connect the driver, stop all on exit. With
    `head_cpus > 0` worker nodes also carry `WORKER_NODE_RESOURCE`. `dashboard=False`: no
    dashboard on the head (the tests' clusters; the head then starts in ~4.1 s instead of ~5.6 s).

    Ray numbers each node's GPUs from 0 and sets CUDA_VISIBLE_DEVICES from that number, so two
    nodes of one machine that both claim a GPU would share the same device: on a GPU machine,
    use one worker node that holds all its GPUs."""
    if num_worker_nodes < 1:
        raise ValueError(f"num_worker_nodes must be >= 1, got {num_worker_nodes}")
    if cpus_per_node < 1:
        raise ValueError(f"cpus_per_node must be >= 1, got {cpus_per_node}")
    if head_cpus < 0:
        raise ValueError(f"head_cpus must be >= 0, got {head_cpus}")
    if gpus_per_node < 0:
        raise ValueError(f"gpus_per_node must be >= 0, got {gpus_per_node}")
    t0 = time.monotonic()
    # The driver attaches to the head, and Ray Train's controller follows the
    # driver's node: both survive any worker-node kill.
    # num_gpus=0: Ray would otherwise give the head every GPU it detects (and the same device ids
    # as a worker node's), while nothing trains there.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "num_gpus": 0,
                                                            "include_dashboard": dashboard})
    handle = LocalCluster(cluster, cpus_per_node, head_cpus, gpus_per_node)
    try:
        for _ in range(num_worker_nodes):
            handle._add_worker_node()
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        handle._wait_registered(NODE_REGISTER_TIMEOUT_S)
        logger.info("%d worker nodes up in %.1f s at %s", num_worker_nodes, time.monotonic() - t0, cluster.address)
        yield handle
    finally:
        handle.shutdown()
        logger.info("cluster stopped")
