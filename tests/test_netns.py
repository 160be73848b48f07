"""A real network partition on one host (tests.support.netns): a Ray node in a network namespace
whose link is cut like a pulled cable.

Run under `flock /tmp/elastic-ray.lock` (one Ray cluster per machine). Needs root and iproute2.
"""
from __future__ import annotations

import os
import time
from typing import Iterator

import pytest

from tests.support import netns
from tests.support.netns import netns_required  # noqa: F401 - autouse: skip, or fail under CI

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

ray = pytest.importorskip("ray")
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

SILENCE_S = 4.0  # a cut node must not answer within this


@pytest.fixture(scope="module")
def pc() -> Iterator[netns.PartitionCluster]:
    with netns.partition_cluster(num_normal_nodes=1, num_isolated_nodes=1, cpus_per_node=1) as cluster:
        yield cluster


@pytest.fixture
def iso(pc: netns.PartitionCluster) -> netns.IsolatedNode:
    return pc.isolated_node_ready()


@ray.remote(num_cpus=0)
class Probe:
    def where(self) -> str:
        return ray.util.get_node_ip_address()

    def blob(self, nbytes: int) -> bytes:
        return os.urandom(nbytes)


@ray.remote(num_cpus=0)
class GlooRank:
    """One rank of a 2-process gloo group; `ifname` is the interface gloo binds to on its side."""

    def __init__(self, ifname: str):
        os.environ["GLOO_SOCKET_IFNAME"] = ifname

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind((netns.HOST_IP, 0))
            return s.getsockname()[1]

    def init(self, rank: int, world_size: int, store_addr: str, port: int, timeout_s: float) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{store_addr}:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))

    def all_reduce(self, value: float) -> tuple[str, object, float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value])
        t0 = time.monotonic()
        try:
            dist.all_reduce(t)
            return "ok", t.item(), time.monotonic() - t0
        except Exception as e:  # noqa: BLE001 - the error is what we report
            return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", time.monotonic() - t0


def _on(node_id: str):
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _gloo_pair(pc: netns.PartitionCluster, iso: netns.IsolatedNode, timeout_s: float):
    """Rank 0 on the normal node (store + gloo on the bridge address), rank 1 in the namespace."""
    normal = GlooRank.options(scheduling_strategy=_on(pc.normal_node_ids()[0])).remote(netns.BRIDGE)
    isolated = GlooRank.options(scheduling_strategy=_on(iso.node_id)).remote(iso.ifname)
    port = ray.get(normal.free_port.remote(), timeout=60)
    ray.get([normal.init.remote(0, 2, netns.HOST_IP, port, timeout_s),
             isolated.init.remote(1, 2, netns.HOST_IP, port, timeout_s)], timeout=120)
    return normal, isolated


def test_actor_on_isolated_node_answers(pc, iso):
    a = Probe.options(scheduling_strategy=_on(iso.node_id)).remote()
    assert ray.get(a.where.remote(), timeout=60) == iso.ip
    ray.kill(a)


def test_gloo_crosses_the_veth(pc, iso):
    normal, isolated = _gloo_pair(pc, iso, timeout_s=30)
    out = ray.get([normal.all_reduce.remote(1.0), isolated.all_reduce.remote(2.0)], timeout=60)
    assert [o[:2] for o in out] == [("ok", 3.0), ("ok", 3.0)], out
    for a in (normal, isolated):
        ray.kill(a)


def test_cut_silences_the_node_and_heal_brings_it_back(pc, iso):
    a = Probe.options(scheduling_strategy=_on(iso.node_id)).remote()
    b = Probe.options(scheduling_strategy=_on(pc.normal_node_ids()[0])).remote()
    assert ray.get([a.where.remote(), b.where.remote()], timeout=60) == [iso.ip, netns.HOST_IP]

    iso.cut()
    t_cut = time.monotonic()
    pending = a.where.remote()
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(pending, timeout=SILENCE_S)
    assert ray.get(b.where.remote(), timeout=10) == netns.HOST_IP  # the rest of the cluster is fine
    assert iso.is_alive_in_gcs()  # not yet declared dead: heal comes first

    iso.heal()
    t_heal = time.monotonic()
    assert ray.get(pending, timeout=60) == iso.ip  # the call made during the cut goes through
    assert ray.get(a.where.remote(), timeout=60) == iso.ip
    print(f"\n[netns] cut for {t_heal - t_cut:.1f} s; the pending call answered "
          f"{time.monotonic() - t_heal:.2f} s after heal")
    assert iso.is_alive_in_gcs()
    for x in (a, b):
        ray.kill(x)


def test_all_reduce_blocks_on_a_cut_peer(pc, iso):
    gloo_timeout_s = 10.0  # > SILENCE_S: the wait before it proves the collective blocks
    normal, isolated = _gloo_pair(pc, iso, timeout_s=gloo_timeout_s)
    out = ray.get([normal.all_reduce.remote(1.0), isolated.all_reduce.remote(2.0)], timeout=60)
    assert [o[0] for o in out] == ["ok", "ok"], out

    iso.cut()
    t_cut = time.monotonic()
    n_ref = normal.all_reduce.remote(1.0)
    i_ref = isolated.all_reduce.remote(2.0)  # both ranks enter the collective; their data can't cross
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(n_ref, timeout=SILENCE_S)  # blocked: no connection-closed error at once
    # It ends only when gloo's own timeout (the group's `timeout`) fires.
    status, detail, took = ray.get(n_ref, timeout=gloo_timeout_s + 60)
    print(f"\n[netns] normal side of the all_reduce after the cut: {status} after {took:.1f} s "
          f"(group timeout {gloo_timeout_s:.0f} s): {detail}")
    assert status == "error" and took >= SILENCE_S
    iso.heal()
    cut_s = time.monotonic() - t_cut
    # The isolated side timed out too, but the driver may not hear it: a gRPC channel that was
    # silent for this long is dropped by the far end (keepalive), and the call made over it
    # fails with ActorUnavailableError once the link is back. The actor itself is alive.
    try:
        i_out = ray.get(i_ref, timeout=gloo_timeout_s + 60)
    except ray.exceptions.ActorUnavailableError as e:
        i_out = f"ActorUnavailableError: {str(e).splitlines()[0][:200]}"
    print(f"[netns] isolated side after a {cut_s:.1f} s cut: {i_out}")
    assert ray.get(isolated.all_reduce.remote(0.0), timeout=120)[0] == "error"  # alive, answers; group broken
    for a in (normal, isolated):
        ray.kill(a)


def test_throttle_slows_transfers(pc, iso):
    a = Probe.options(scheduling_strategy=_on(iso.node_id)).remote()
    nbytes = 1_000_000
    ray.get(a.where.remote(), timeout=60)
    t0 = time.monotonic()
    assert len(ray.get(a.blob.remote(nbytes), timeout=60)) == nbytes
    fast = time.monotonic() - t0
    iso.throttle(rate_kbit=2000)  # 250 kB/s each way: 1 MB needs >= 4 s
    try:
        t0 = time.monotonic()
        assert len(ray.get(a.blob.remote(nbytes), timeout=120)) == nbytes
        slow = time.monotonic() - t0
    finally:
        iso.heal()
    print(f"\n[netns] 1 MB from the isolated node: {fast:.2f} s, throttled to 2 Mbit/s: {slow:.2f} s")
    assert slow > 2.0  # the token bucket makes this a lower bound, not a race
    ray.kill(a)


def test_slow_adds_latency(pc, iso):
    if not netns.netem_available():
        pytest.skip("kernel has no sch_netem: slow() unavailable here (cut/throttle still work)")
    a = Probe.options(scheduling_strategy=_on(iso.node_id)).remote()
    ray.get(a.where.remote(), timeout=60)
    iso.slow(delay_ms=200)
    try:
        t0 = time.monotonic()
        ray.get(a.where.remote(), timeout=60)
        took = time.monotonic() - t0
    finally:
        iso.heal()
    print(f"\n[netns] one call with 200 ms each way: {took:.2f} s")
    assert took >= 0.4
    ray.kill(a)
