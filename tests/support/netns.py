"""A real network partition on one host: Ray nodes inside Linux network namespaces.

An `IsolatedNode` is a Ray worker node whose every process lives in its own
network namespace, linked to the host by one veth pair. Cutting that link
(`cut()`) partitions the node from the rest of the cluster the way a pulled
cable does: packets vanish both ways, no socket is closed, no RST or FIN is
sent, no sender gets an error. `heal()` puts the link back; TCP connections
that were not given up on resume.

Addresses (all on this machine, never anything else):

    host bridge `elt-br0`        10.213.0.1/24   head, normal nodes, the driver
    namespace `elt-ns<i>`        10.213.0.<10+i>/24 on `elt-n<i>` (veth end inside)
    host veth end `elt-h<i>`     no address: a port of the bridge

The namespace has `lo` and its veth end and no other route: it can reach the
10.213.0.0/24 subnet (i.e. the host bridge and the other namespaces) and
nothing beyond. The head, the normal nodes and the driver all advertise the
bridge address, which is a local address of the host, so every process of
the cluster (in or out of a namespace) can reach every other one; nodes of
`ray.cluster_utils.Cluster` advertise 127.0.0.1 by default, which a
namespace cannot reach (its own `lo` is another loopback).

Why the `blackhole` qdisc for `cut()`: it drops every packet queued on the
device and reports success to the sender, so TCP just retransmits into the
void: silence, like a pulled cable. Taking the link down instead removes the
route, and a sender then gets ENETUNREACH / EHOSTUNREACH at once: an error,
not silence. `tc netem loss 100%` would be equivalent to blackhole, but
netem (like prio, fq, codel) is not compiled into every kernel (it is not in
the kernel of the machine this was written on); blackhole, tbf and htb are
part of the core scheduler support. `slow()` needs netem and raises
`NetemUnavailable` without it; `throttle()` (a tbf rate limit) works anyway.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and `ip`/`tc` from iproute2.
Only one such cluster per machine at a time (fixed names and addresses);
run under `flock /tmp/elastic-ray.lock` like every Ray test of the project.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

logger = logging.getLogger(__name__)
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[netns] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

BRIDGE = "elt-br0"
SUBNET_PREFIX = "10.213.0"  # a /24; private, and only ever assigned to interfaces created here
PREFIX_LEN = 24
HOST_IP = f"{SUBNET_PREFIX}.1"
NS_PREFIX = "elt-ns"
VETH_HOST_PREFIX = "elt-h"
VETH_NS_PREFIX = "elt-n"
MAX_NODES = 200  # 10.213.0.10 .. 10.213.0.209
NODE_REGISTER_TIMEOUT_S = 120.0
OBJECT_STORE_BYTES = 150 * 1024 * 1024  # as ray.cluster_utils.Cluster's nodes


class NetemUnavailable(RuntimeError):
    """The running kernel has no `netem` queueing discipline (sch_netem)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ns_exec(ns: str, *cmd: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", ns, *cmd)


def netns_unsupported_reason() -> str | None:
    """Why network-namespace drills can't run here, or None if they can (for pytest skips)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip`/`tc` missing (apt-get install -y iproute2)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"{NS_PREFIX}-probe"
    _run("ip", "netns", "del", probe, check=False)
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def in_ci() -> bool:
    """CI says so (`CI=true`, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture(scope="module", autouse=True)
def netns_required() -> None:
    """A drill module's first fixture (import it there): skips the module where network
    namespaces cannot run here, and under CI=true fails every test instead. CI runs as root with
    iproute2, so a skip there would hide a broken set-up behind a green run."""
    reason = netns_unsupported_reason()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI=true, and the network-namespace drill cannot run here: {reason}",
                    pytrace=False)
    pytest.skip(reason)


def _qdisc_supported(kind_args: list[str]) -> bool:
    """Whether the kernel knows a qdisc, tried on a throwaway veth pair."""
    a, b = f"{VETH_HOST_PREFIX}-qa", f"{VETH_HOST_PREFIX}-qb"
    _run("ip", "link", "del", a, check=False)
    _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
    try:
        return _run("tc", "qdisc", "add", "dev", a, "root", *kind_args, check=False).returncode == 0
    finally:
        _run("ip", "link", "del", a, check=False)


_netem: bool | None = None


def netem_available() -> bool:
    global _netem
    if _netem is None:
        _netem = _qdisc_supported(["netem", "delay", "1ms"])
    return _netem


def ensure_bridge() -> None:
    """The host end of every partition drill: a bridge holding `HOST_IP` (idempotent)."""
    if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    if HOST_IP not in _run("ip", "-o", "-4", "addr", "show", "dev", BRIDGE).stdout:
        _run("ip", "addr", "add", f"{HOST_IP}/{PREFIX_LEN}", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")


def delete_bridge() -> None:
    _run("ip", "link", "del", BRIDGE, check=False)


def _kill_ns_processes(ns: str) -> int:
    """SIGKILL every process in namespace `ns` (all of them are ours: we made it). Returns how many."""
    killed = 0
    for _ in range(20):  # processes may fork while we kill: repeat until none is left
        r = _run("ip", "netns", "pids", ns, check=False)
        pids = [int(p) for p in r.stdout.split()] if r.returncode == 0 else []
        if not pids:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.1)
    return killed


def cleanup_stale() -> None:
    """Remove namespaces, veths and the bridge left by an earlier run of this module that crashed.

    Only names this module creates (`elt-ns*`, `elt-h*`, `elt-br0`) are touched."""
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(NS_PREFIX):
            _kill_ns_processes(ns)
            _run("ip", "netns", "del", ns, check=False)
            logger.info("removed stale namespace %s", ns)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(VETH_HOST_PREFIX):
            _run("ip", "link", "del", name, check=False)
    delete_bridge()


class IsolatedNode:
    """A Ray worker node in its own network namespace, joined to the cluster at `gcs_address`.

    Use as a context manager (or call `close()`): the namespace, its veth pair
    and every process in it are removed on exit, whatever happened."""

    def __init__(self, gcs_address: str, index: int, *, num_cpus: int = 1,
                 resources: dict[str, float] | None = None,
                 object_store_memory: int = OBJECT_STORE_BYTES,
                 register_timeout_s: float = NODE_REGISTER_TIMEOUT_S):
        if not 0 <= index < MAX_NODES:
            raise ValueError(f"index must be in [0, {MAX_NODES}), got {index}")
        self.gcs_address = gcs_address
        self.index = index
        self.namespace = f"{NS_PREFIX}{index}"
        self.host_ifname = f"{VETH_HOST_PREFIX}{index}"
        self.ifname = f"{VETH_NS_PREFIX}{index}"  # inside the namespace (e.g. for GLOO_SOCKET_IFNAME)
        self.ip = f"{SUBNET_PREFIX}.{10 + index}"
        self.num_cpus = num_cpus
        self.resources = resources or {}
        self.object_store_memory = object_store_memory
        self.register_timeout_s = register_timeout_s
        self.node_id: str | None = None
        self.state = "new"  # new -> up -> (cut | slow | throttled | up)* -> closed
        self.longest_cut_s = 0.0  # the longest a cut of this node lasted
        self._cut_at: float | None = None
        self._proc: subprocess.Popen | None = None
        self._log_path: Path | None = None

    # --- lifecycle ---------------------------------------------------------
    def start(self) -> "IsolatedNode":
        ensure_bridge()
        ns, h, n = self.namespace, self.host_ifname, self.ifname
        if _run("ip", "netns", "list").stdout.split().count(ns):
            raise RuntimeError(f"namespace {ns} exists already (run cleanup_stale())")
        try:
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", h, "type", "veth", "peer", "name", n)
            _run("ip", "link", "set", n, "netns", ns)
            _run("ip", "link", "set", h, "master", BRIDGE)
            _run("ip", "link", "set", h, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip}/{PREFIX_LEN}", "dev", n)
            _run("ip", "-n", ns, "link", "set", n, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            self._start_ray()
            self._wait_registered()
        except BaseException:
            self.close()
            raise
        self.state = "up"
        return self

    def _start_ray(self) -> None:
        import json

        ray_bin = str(Path(sys.executable).parent / "ray")
        cmd = [ray_bin, "start", f"--address={self.gcs_address}", f"--node-ip-address={self.ip}",
               f"--num-cpus={self.num_cpus}", "--num-gpus=0",
               f"--object-store-memory={self.object_store_memory}", "--disable-usage-stats", "--block"]
        if self.resources:
            cmd.append(f"--resources={json.dumps(self.resources)}")
        # Every process of the node (raylet, workers) inherits this: gloo binds to the namespace's
        # veth end instead of resolving the hostname (an address the namespace does not have).
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", GLOO_SOCKET_IFNAME=self.ifname)
        log_dir = Path(os.environ.get("ELASTIC_NETNS_LOG_DIR", "/tmp/elastic-netns"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = log_dir / f"{self.namespace}.log"
        log = open(self._log_path, "wb")
        # start_new_session: a Ctrl-C on the test run must not reach the node before close() does.
        self._proc = subprocess.Popen(_ns_exec(self.namespace, *cmd), stdout=log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True)
        log.close()

    def _wait_registered(self) -> None:
        import ray

        deadline = time.monotonic() + self.register_timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"`ray start` in {self.namespace} exited with {self._proc.returncode}; "
                                   f"log: {self._log_path}:\n{self._log_tail()}")
            for node in ray.nodes():
                if node["Alive"] and node["NodeManagerAddress"] == self.ip:
                    self.node_id = node["NodeID"]
                    logger.info("isolated node %s up: %s in %s", self.node_id[:8], self.ip, self.namespace)
                    return
            time.sleep(0.25)
        raise TimeoutError(f"isolated node {self.ip} not registered after {self.register_timeout_s} s; "
                           f"log: {self._log_path}:\n{self._log_tail()}")

    def _log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self._log_path.read_text(errors="replace")[-n:] if self._log_path else ""
        return ""

    def close(self) -> None:
        """Kill every process of the node (all live in the namespace), delete the namespace and veth."""
        if self.state == "closed":
            return
        killed = _kill_ns_processes(self.namespace)
        if self._proc is not None:
            with contextlib.suppress(Exception):
                self._proc.kill()
            with contextlib.suppress(Exception):
                self._proc.wait(timeout=10)
        _run("ip", "link", "del", self.host_ifname, check=False)  # deletes the peer in the namespace too
        _run("ip", "netns", "del", self.namespace, check=False)
        self.state = "closed"
        logger.info("isolated node %s closed (%d processes killed)", self.namespace, killed)

    def __enter__(self) -> "IsolatedNode":
        return self if self.state != "new" else self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def pids(self) -> list[int]:
        """Every process in the namespace (the node's raylet, workers, agents)."""
        r = _run("ip", "netns", "pids", self.namespace, check=False)
        return [int(p) for p in r.stdout.split()]

    # --- faults ------------------------------------------------------------
    def _set_qdisc(self, *args: str) -> None:
        """Same root qdisc on both ends of the link (each end shapes what it sends)."""
        _run("tc", "qdisc", "replace", "dev", self.host_ifname, "root", *args)
        _run(*_ns_exec(self.namespace, "tc", "qdisc", "replace", "dev", self.ifname, "root", *args))

    def _clear_qdisc(self) -> None:
        _run("tc", "qdisc", "del", "dev", self.host_ifname, "root", check=False)
        _run(*_ns_exec(self.namespace, "tc", "qdisc", "del", "dev", self.ifname, "root"), check=False)

    def cut(self) -> None:
        """Total silence both ways, no error to any sender: a pulled cable."""
        self._set_qdisc("blackhole")
        self.state = "cut"
        self._cut_at = time.monotonic()
        logger.info("cut %s (%s)", self.namespace, self.ip)

    def heal(self) -> None:
        """Undo cut/slow/throttle: the link passes everything again."""
        self._clear_qdisc()
        if self.state == "cut" and self._cut_at is not None:
            self.longest_cut_s = max(self.longest_cut_s, time.monotonic() - self._cut_at)
        self.state = "up"
        logger.info("healed %s", self.namespace)

    def slow(self, delay_ms: float, jitter_ms: float = 0.0) -> None:
        """Add `delay_ms` one way in each direction (so the round trip grows by 2 x delay_ms). Needs netem."""
        if not netem_available():
            raise NetemUnavailable("this kernel has no sch_netem (tc qdisc netem); use throttle() or cut()")
        args = ["netem", "delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
        self._set_qdisc(*args)
        self.state = "slow"

    def throttle(self, rate_kbit: int, latency_ms: int = 1000) -> None:
        """Limit each direction to `rate_kbit` (token bucket; packets queued past `latency_ms` are dropped)."""
        burst = max(1600, rate_kbit * 1000 // 8 // 100)  # 10 ms worth of bytes, at least one packet
        self._set_qdisc("tbf", "rate", f"{rate_kbit}kbit", "burst", str(burst), "latency", f"{latency_ms}ms")
        self.state = "throttled"

    def is_alive_in_gcs(self) -> bool:
        import ray

        return any(n["NodeID"] == self.node_id and n["Alive"] for n in ray.nodes())


# The longest cut after which a node is reused by the next test; after a longer one it is replaced
# (`isolated_node_ready`), at the cost of a node's start.
SAFE_CUT_S = 5.0


class PartitionCluster:
    """A head (0 CPUs), normal nodes and isolated nodes, all reachable from every namespace.

    The head, the normal nodes and the driver advertise `HOST_IP`; build it with
    `partition_cluster()`."""

    def __init__(self, cpus_per_node: int):
        from ray.cluster_utils import Cluster

        self.cpus_per_node = cpus_per_node
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": HOST_IP, "include_dashboard": False})
        self.isolated: list[IsolatedNode] = []
        self._next_index = 0

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_normal_node(self) -> str:
        """A node on the host (outside any namespace); returns its node id."""
        return self.cluster.add_node(num_cpus=self.cpus_per_node, node_ip_address=HOST_IP).node_id

    def normal_node_ids(self) -> list[str]:
        return [n.node_id for n in self.cluster.worker_nodes]

    def isolated_node_ready(self) -> IsolatedNode:
        """The newest isolated node, up and not cut: a fresh one if Ray declared the last one dead
        (a cut long enough), healed if an earlier test left it cut or throttled."""
        node = self.isolated[-1]
        if node.state == "cut":
            node.heal()
        # After a long cut Ray's GCS may declare the node dead seconds after the heal (its health
        # checks count misses and decide later; the raylet then exits): seen alive here, such a
        # node died under the next test's first workers (test_partition.py). It is replaced.
        if node.state == "closed" or node.longest_cut_s > SAFE_CUT_S or not node.is_alive_in_gcs():
            node.close()
            node = self.add_isolated_node()
        if node.state != "up":
            node.heal()
        return node

    def add_isolated_node(self, **kwargs) -> IsolatedNode:
        node = IsolatedNode(self.address, self._next_index, num_cpus=kwargs.pop("num_cpus", self.cpus_per_node),
                            **kwargs)
        self._next_index += 1
        self.isolated.append(node)
        return node.start()

    def shutdown(self) -> None:
        import ray

        for node in self.isolated:
            with contextlib.suppress(Exception):
                node.close()
        with contextlib.suppress(Exception):
            ray.shutdown()
        for node in list(self.cluster.worker_nodes):
            try:
                self.cluster.remove_node(node, allow_graceful=False)
            except Exception:  # noqa: BLE001 - kill what is left of it
                for _, proc in node.live_processes():
                    with contextlib.suppress(Exception):
                        proc.kill()
        try:
            self.cluster.shutdown()
        except Exception:  # noqa: BLE001
            head = self.cluster.head_node
            if head is not None:
                for _, proc in head.live_processes():
                    with contextlib.suppress(Exception):
                        proc.kill()
        delete_bridge()


@contextlib.contextmanager
def partition_cluster(num_normal_nodes: int = 1, num_isolated_nodes: int = 1,
                      cpus_per_node: int = 1) -> Iterator[PartitionCluster]:
    """Start the bridge, a head, `num_normal_nodes` host nodes and `num_isolated_nodes` namespaced
    nodes; connect the driver; tear everything down on exit."""
    import ray

    reason = netns_unsupported_reason()
    if reason:
        raise RuntimeError(reason)
    cleanup_stale()
    ensure_bridge()  # before the head: the head binds to HOST_IP
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # The head and the normal nodes are children of this process and pass their environment on to
    # their workers: gloo there binds to the bridge (the isolated nodes get their veth end, see
    # IsolatedNode._start_ray), so a gloo group can span the host and the namespaces.
    saved_ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = BRIDGE
    t0 = time.monotonic()
    pc = None
    try:
        pc = PartitionCluster(cpus_per_node)
        for _ in range(num_normal_nodes):
            pc.add_normal_node()
        ray.init(address=pc.address, _node_ip_address=HOST_IP, logging_level=logging.WARNING)
        for _ in range(num_isolated_nodes):
            pc.add_isolated_node()
        logger.info("partition cluster up in %.1f s: head %s, %d normal, %d isolated", time.monotonic() - t0,
                    pc.address, num_normal_nodes, num_isolated_nodes)
        yield pc
    finally:
        if pc is not None:
            pc.shutdown()
        else:
            with contextlib.suppress(Exception):
                ray.shutdown()
        cleanup_stale()
        if saved_ifname is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved_ifname
        logger.info("partition cluster stopped")


def wait_node_dead(node_id: str, timeout_s: float, poll_s: float = 0.2) -> float | None:
    """Seconds until the GCS lists `node_id` as dead (polling `ray.nodes()`), or None on timeout."""
    import ray

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if any(n["NodeID"] == node_id and not n["Alive"] for n in ray.nodes()):
            return time.monotonic() - t0
        time.sleep(poll_s)
    return None
