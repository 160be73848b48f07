"""Pipeline stages that survive the loss of a stage, on a real local multi-node Ray cluster
(head + 4 one-CPU nodes), training the GPT-style example (6 units: embedding, 4 blocks, head).

* 3 stages x 1 replica, the middle stage's node killed: no replica holds that stage, but each
  stage's state is copied to another node's memory every step (checkpoint.memory_every_steps):
  every stage returns to the newest step all three copies survived at, with no storage read;
  with checkpoint.memory_sync (a step reported done has its copies in) no step is redone, though
  the lost stage's link to its buddy is slowed (1 s a copy) just before its node dies. The run
  ends bit-identical, rank by rank, to an uninterrupted one.
* 2 stages x 2 replicas, one stage's process killed: its replacement copies the surviving
  replica of that stage from memory; no storage read, no step redone, bit-identical.
* 3 stages, a node lost with no free capacity, copies off (memory_every_steps 0): the pipeline
  is re-partitioned onto 2 stages (the lost stage's layers read by name from the checkpoint), then grows back to 3 stages when
  capacity returns (every layer's state moved between ranks in memory, by name); every sample
  is seen once, and the run still ends bit-identical to the uninterrupted one.
"""
from __future__ import annotations

import threading
import uuid

import pytest
import ray

from elastic import Trainer
from tests.ray_fixtures import assert_exact_once, cluster, ray_cluster  # noqa: F401 - pytest fixtures
from tests.spawn_ranks import uninterrupted_digests
from tests.test_resize import Blocker, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]

NUM_STEPS, EVERY, FAULT_STEP, BATCH = 80, 10, 25, 16


def num_samples() -> int:
    from examples.gpt import build_dataset
    return len(build_dataset())


def job(tmp_path, stages, replicas, chaos=(), name=None, steps=NUM_STEPS, **over):
    j = {
        "run": {"name": name or f"p-{uuid.uuid4().hex[:8]}", "num_steps": steps, "seed": 5},
        "scaling": {"num_workers": stages * replicas},
        "failure": {"max_failures": 2, "hang_floor_s": 10},
        "checkpoint": {"storage_uri": str(tmp_path / "runs"), "every_steps": EVERY},
        "train": {"model": "examples.gpt:build_model", "dataset": "examples.gpt:build_dataset",
                  "optimizer": "examples.gpt:build_optimizer", "global_batch_size": BATCH,
                  "strategy": "pipeline",
                  "pipeline": {"stages": stages, "microbatches": 4, "schedule": "1f1b",
                               "loss": "examples.gpt:stage_loss"}},
        "chaos": [dict(c) for c in chaos],
    }
    for k, v in over.items():
        j[k] = {**j.get(k, {}), **v}
    return j


@pytest.fixture(scope="module")
def baseline_3x1(tmp_path_factory):
    """Baselines come from ranks forked without Ray (tests/spawn_ranks.py): the same digests."""
    d = uninterrupted_digests(job(tmp_path_factory.mktemp("b31"), 3, 1))
    assert len(set(d.values())) == 3  # three stages, three different states
    return d


@pytest.fixture(scope="module")
def baseline_2x2(tmp_path_factory):
    d = uninterrupted_digests(job(tmp_path_factory.mktemp("b22"), 2, 2))
    assert d[0] == d[2] and d[1] == d[3] and d[0] != d[1]  # replicas of a stage agree
    return d


def test_middle_stage_node_kill_restores_every_stage_from_in_memory_copies(cluster, baseline_3x1, tmp_path):  # noqa: F811
    j = job(tmp_path, 3, 1, [{"action": "slow_copies", "rank": 1, "at_step": FAULT_STEP - 2, "delay_s": 1.0},
                             {"action": "kill_node", "rank": 1, "at_step": FAULT_STEP}],
            checkpoint={"memory_sync": True})  # a copy every step, each in before its step is reported
    j["run"]["sample_ledger"] = True
    result = Trainer(j).fit(progress=False)
    assert result.digests == baseline_3x1
    (plan,) = result.events_of("restore_plan")
    assert plan["source"] == "FromShards" and "rank 1 from rank" in plan["reason"], plan
    restored = result.events_of("restored")[-1]
    assert restored["uri"] is None and restored["source"].startswith("re-sharded in memory"), restored
    (rec,) = result.events_of("recovered")
    assert rec["resumed_step"] == FAULT_STEP and rec["lost_steps"] == 0, rec
    assert_exact_once(tmp_path / "runs" / j["run"]["name"] / "ledger.json", NUM_STEPS, BATCH, num_samples(), seed=5,
                      lost_rank_upto=(1, FAULT_STEP))


def test_stage_lost_with_a_surviving_replica_is_copied_from_memory(cluster, baseline_2x2, tmp_path):  # noqa: F811
    j = job(tmp_path, 2, 2, [{"action": "kill_process", "rank": 1, "at_step": FAULT_STEP}])
    j["run"]["sample_ledger"] = True
    result = Trainer(j).fit(progress=False)
    assert result.digests == baseline_2x2
    (plan,) = result.events_of("restore_plan")
    assert plan["source"] == "FromPeer" and "no storage read" in plan["reason"]
    restored = result.events_of("restored")[-1]
    # Stage 1's replacement copies rank 3 (stage 1 of the other replica); stage 0 keeps its own.
    assert restored["uri"] is None and restored["source"] == "slot replicas [0, 3]"
    (rec,) = result.events_of("recovered")
    assert rec["resumed_step"] == FAULT_STEP and rec["lost_steps"] == 0
    assert_exact_once(tmp_path / "runs" / j["run"]["name"] / "ledger.json", NUM_STEPS, BATCH, num_samples(), seed=5)


def test_node_loss_without_capacity_repartitions_then_grows_back(cluster, baseline_3x1, tmp_path):  # noqa: F811
    blocker = Blocker.remote()  # holds the 4th node's CPU: a lost stage has nowhere to go
    ray.get(blocker.node.remote())
    steps = NUM_STEPS
    j = job(tmp_path, 3, 1, [{"action": "kill_node", "rank": 1, "at_step": FAULT_STEP}], steps=steps,
            scaling={"min_workers": 2, "shrink_after_s": 2, "grow_check_s": 1},
            checkpoint={"memory_every_steps": 0})  # the storage path: the lost stage's layers by name
    j["run"]["sample_ledger"] = True
    # Steps at 2 stages are paced (0.4 s instead of 0.035 s) so the run cannot end before the
    # worker queued for the returned capacity has warmed; the arithmetic is unchanged.
    j["train"]["pipeline"]["loss"] = "tests.support.workloads:stage_loss_slower_while_shrunk"
    name = j["run"]["name"]
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("result", Trainer(j).fit(progress=False)))
    t.start()
    wait_for(tmp_path / "runs" / name / "events.jsonl", "resized", lambda e: e["new_world_size"] == 2)
    ray.kill(blocker)  # capacity returns: the queued worker warms, and the pipeline grows back
    t.join(timeout=360)
    result = out["result"]
    resized = result.events_of("resized")
    assert [(r["old_layout"], r["new_layout"]) for r in resized[:1]] == [("3 stage(s) x 1 replica(s)",
                                                                          "2 stage(s) x 1 replica(s)")]
    assert [(r["old_world_size"], r["new_world_size"]) for r in resized] == [(3, 2), (2, 3)]
    assert resized[0]["path"] == "storage" and resized[1]["path"] == "memory"
    done = result.events_of("resize_completed")
    assert done[-1]["source"].startswith("re-sharded in memory")
    assert result.metrics["step"] == steps and len(result.digests) == 3
    # Moving stage boundaries changes where activations cross processes, not the arithmetic: every
    # unit computes the same micro-batches in the same order, and with one replica nothing is
    # summed across ranks. So even re-partitioned twice, the run ends bit-identical.
    assert result.digests == baseline_3x1
    assert_exact_once(tmp_path / "runs" / name / "ledger.json", steps, BATCH, num_samples(), seed=5)


def test_frozen_stage_is_found_by_silence_and_its_neighbours_keep_their_state(cluster, baseline_2x2, tmp_path):  # noqa: F811
    """A stopped process closes no socket: its pipeline neighbours block in a point-to-point
    send or receive on it (and the other stage's replicas in their gradient all-reduce). The
    controller finds the silence, cuts every survivor's group sockets, and they come back with
    the state of their last completed step."""
    result = Trainer(job(tmp_path, 2, 2, [{"action": "freeze_process", "rank": 1, "at_step": FAULT_STEP}])).fit(
        progress=False)
    assert result.digests == baseline_2x2
    (silence,) = result.events_of("silence_detected")
    assert silence["ranks"] == [1]
    restored = result.events_of("restored")[-1]
    assert restored["uri"] is None and restored["source"] == "slot replicas [0, 3]"
    (rec,) = result.events_of("recovered")
    assert rec["lost_steps"] == 0
    # Found by its silence, not by the hang bound (10 s here): silence first, and no hang at all.
    order = [e["kind"] for e in result.events]
    assert not result.events_of("hang_detected")
    assert order.index("silence_detected") < order.index("failure_detected"), order
