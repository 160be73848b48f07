"""How long Ray's metrics agent serves a gauge series that is no longer set: one actor sets two
gauges at the start; it sets one of them again, to the same value, every REFRESH_S (as the
controller's `RayBackend` does). The head's agent is scraped every 0.5 s; each change of the
set of series served is printed with its time. A one-node local cluster, no elastic code.

    python -m benchmarks.probes.gauge_lapse [REPORT_INTERVAL_MS] [DURATION_S]

Measured with Ray 2.60 (2026-11-30): the gauge set once left the scrape 20.4 s after it was
first served at 1000 ms, within 20-30 s at 10000 ms; the one set again stayed throughout.
"""
from __future__ import annotations

import socket
import sys
import time
import urllib.request

REFRESH_S = 5.0


def main(interval_ms: int = 1000, duration_s: float = 45.0) -> None:
    import ray
    from ray.cluster_utils import Cluster

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "metrics_export_port": port, "_system_config": {"metrics_report_interval_ms": interval_ms}})
    ray.init(address=cluster.address)

    @ray.remote(num_cpus=0)
    class Setter:
        def __init__(self):
            from ray.util.metrics import Gauge

            self.gauges = {name: Gauge(f"probe_{name}", name, tag_keys=("run",)) for name in ("once", "again")}

        def set(self, name: str) -> None:
            self.gauges[name].set(5, tags={"run": "probe"})

    def served() -> list[str]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return sorted({line.split("{")[0] for line in body.splitlines() if line.startswith("ray_probe_")})

    try:
        setter = Setter.remote()
        ray.get([setter.set.remote("once"), setter.set.remote("again")])
        t0, last, next_set = time.monotonic(), None, REFRESH_S
        while (now := time.monotonic() - t0) < duration_s:
            if now >= next_set:
                ray.get(setter.set.remote("again"))
                next_set += REFRESH_S
            if (got := served()) != last:
                print(f"{now:6.1f} s  {got}", flush=True)
                last = got
            time.sleep(0.5)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 1000, float(args[1]) if len(args) > 1 else 45.0)
