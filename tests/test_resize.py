"""Elastic world size on a real local multi-node cluster: shrink when a lost rank cannot be
replaced, grow back when capacity appears. DDP with state moved from survivors' memory."""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import ray

from elastic import Trainer
from elastic.workload import NUM_SAMPLES
from elastic.observability.events import parse_lines
from tests.ray_fixtures import assert_exact_once, cluster, ray_cluster  # noqa: F401 - pytest fixtures

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]


@ray.remote(num_cpus=1)
class Blocker:
    """Holds one node's only CPU, so a lost rank has nowhere to go until it is released."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def wait_for(path, kind, pred=lambda e: True, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            for e in parse_lines(path.read_text(), str(path)):  # the live log may end in a half-written line
                if e["kind"] == kind and pred(e):
                    return e
        time.sleep(0.2)
    raise AssertionError(f"no {kind} event within {timeout_s}s")


def test_shrink_on_node_loss_then_grow_back(cluster, tmp_path):  # noqa: F811
    blocker = Blocker.remote()
    ray.get(blocker.node.remote())
    name = f"resize-{uuid.uuid4().hex[:6]}"
    j = {
        "run": {"name": name, "num_steps": 400, "seed": 3, "sample_ledger": True},
        "scaling": {"num_workers": 3, "min_workers": 2, "max_workers": 3, "shrink_after_s": 2, "grow_check_s": 1},
        "failure": {"max_failures": 2},
        "checkpoint": {"storage_uri": str(tmp_path / "runs"), "every_steps": 50},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "tests.support.workloads:loss_slower_while_shrunk", "global_batch_size": 48},
        "chaos": [{"action": "kill_node", "rank": 1, "at_step": 20}],
    }
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("result", Trainer(j).fit(progress=False)))
    t.start()
    events = tmp_path / "runs" / name / "events.jsonl"
    shrunk = wait_for(events, "resized", lambda e: e["new_world_size"] == 2)
    ray.kill(blocker)  # capacity appears: the queued worker starts, warms, and the group grows back
    t.join(timeout=240)
    result = out["result"]
    resized = result.events_of("resized")
    sizes = [(r["old_world_size"], r["new_world_size"]) for r in resized]
    assert sizes == [(3, 2), (2, 3)]
    assert shrunk["path"] == "memory" and "shrink_after_s" in shrunk["reason"]
    grow = [d for d in result.events_of("decision") if d["decision"] == "Grow"]
    assert len(grow) == 1 and "max_workers=3" in grow[0]["reason"]
    rec = result.events_of("recovered")[0]
    assert rec["lost_steps"] == 0 and rec["world_size"] == 2
    assert result.metrics["step"] == 400
    assert len(result.digests) == 3 and len(set(result.digests.values())) == 1
    # Exact-once data across 3 -> 2 -> 3: 400 steps x 48 samples = 2.3 epochs of 8192.
    assert_exact_once(tmp_path / "runs" / name / "ledger.json", 400, 48, NUM_SAMPLES, seed=3,
                      lost_rank_upto=(1, 20))
