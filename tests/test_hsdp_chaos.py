"""HSDP 2 x 2 (train.fsdp.replicate: 2) on a real local cluster (head + 4 or 5 one-CPU nodes):
faults recovered from the other replica group's memory.

Each of the two groups shards the state over 2 ranks; ranks 0 and 2 hold shard 0, ranks 1 and 3
shard 1. A node killed between checkpoints takes rank 1: its shard lives on in rank 3's memory.
  * with a replacement (a warm spare): the group re-forms at 2 x 2 and the
    replacement takes shard 1 from rank 3, with no storage read and no step redone (the
    survivors finished the fault step; their all-reduce across groups had the lost rank's
    contribution). The run ends bit-identical to an uninterrupted one.
  * without one: the group shrinks to one replica group (1 x 2), each shard from a survivor that
    holds it. There the state is held once, so each rank's shards are copied to the other's node;
    a process killed at 1 x 2 is restored from those copies, rank to rank. Then the group grows
    back to 2 x 2 when a node joins, the new group copying from the old.
Every sample is seen once either way (sample ledger)."""
from __future__ import annotations

import threading
import uuid

import pytest

from elastic import Trainer
from elastic.workload import NUM_SAMPLES
from tests.ray_fixtures import assert_exact_once, cluster, ray_cluster  # noqa: F401 - pytest fixtures
from tests.spawn_ranks import uninterrupted_digests
from tests.test_resize import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

NUM_STEPS, EVERY, FAULT_STEP, BATCH, SEED = 30, 10, 15, 48, 5


def hsdp_job(tmp_path, chaos=(), steps=NUM_STEPS, loss="elastic.workload:loss_fn", **scaling) -> dict:
    return {
        "run": {"name": f"h-{uuid.uuid4().hex[:8]}", "num_steps": steps, "seed": SEED, "sample_ledger": True},
        "scaling": {"num_workers": 4, **scaling},
        "failure": {"max_failures": 2, "hang_floor_s": 5},
        "checkpoint": {"storage_uri": str(tmp_path / "runs"), "every_steps": EVERY},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": loss, "global_batch_size": BATCH, "strategy": "fsdp",
                  "fsdp": {"replicate": 2}},
        "chaos": [dict(c) for c in chaos],
    }


def _assert_from_the_other_group(result, tmp_path, j, steps=NUM_STEPS):
    (plan,) = result.events_of("restore_plan")
    assert plan["source"] == "FromPeer" and "every shard (HSDP) from a surviving replica" in plan["reason"], plan
    assert "no storage read" in plan["reason"], plan
    restored = result.events_of("restored")[-1]
    assert restored["uri"] is None and restored["source"].startswith("slot replicas"), restored
    assert all(e["uri"] is None for e in result.events_of("restored")), result.events_of("restored")
    assert_exact_once(tmp_path / "runs" / j["run"]["name"] / "ledger.json", steps, BATCH, NUM_SAMPLES,
                      seed=SEED, lost_rank_upto=(1, FAULT_STEP))


def test_hsdp_shrinks_to_one_group_from_memory_keeps_copies_there_and_grows_back(cluster, tmp_path):  # noqa: F811
    # 4 ranks on the 4 nodes: the killed node's rank has nowhere to go, so the run shrinks. At
    # one group the state is held once: each rank's shards are copied to the other's node, and a
    # process killed there is restored from those copies, not from storage.
    steps, second = 70, 24
    j = hsdp_job(tmp_path, [{"action": "kill_node", "rank": 1, "at_step": FAULT_STEP},
                            {"action": "kill_process", "rank": 1, "at_step": second}], steps=steps,
                 loss="tests.support.workloads:loss_slower_while_shrunk",
                 min_workers=2, max_workers=4, shrink_after_s=2, grow_check_s=1)
    j["checkpoint"]["memory_max_overhead"] = 1.0  # a copy at every step the last one's send allows
    j["failure"]["max_failures"] = 3
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("result", Trainer(j).fit(progress=False)))
    t.start()
    events = tmp_path / "runs" / j["run"]["name"] / "events.jsonl"
    wait_for(events, "resized", lambda e: e["new_world_size"] == 2)
    wait_for(events, "restored", lambda e: "copies of step" in e["source"], timeout_s=180)
    cluster.ensure_worker_nodes(4)  # a node joins: the group grows back by a whole replica group
    t.join(timeout=280)
    result = out["result"]
    sizes = [(r["old_world_size"], r["new_world_size"], r["path"]) for r in result.events_of("resized")]
    assert sizes == [(4, 2, "memory"), (2, 4, "memory")], sizes
    done = result.events_of("resize_completed")
    assert done[0]["lost_steps"] == 0 and done[0]["resumed_step"] >= FAULT_STEP, done[0]
    assert done[1]["lost_steps"] == 0, done[1]
    assert result.metrics["step"] == steps
    # Copies only while one group held the state: buddies on other nodes, then none at 2 x 2 again.
    (pairs,) = {tuple(sorted(b["buddies"].items())) for b in result.events_of("buddies")}
    assert len(pairs) == 2 and all(r != b for r, b in pairs), pairs
    plans = result.events_of("restore_plan")
    assert [p["source"] for p in plans] == ["FromPeer", "FromShards"], plans
    assert "every shard (HSDP) from a surviving replica" in plans[0]["reason"], plans[0]
    (rec,) = [e for e in result.events_of("recovered") if e["fault_step"] >= second]  # (the shrink's is first)
    assert rec["lost_steps"] <= 1 and rec["resumed_step"] >= second - 1, rec  # a copy every step: <= 1 redone
    restored = result.events_of("restored")
    assert all(e["uri"] is None for e in restored), restored  # no storage read, either fault
    (copied,) = [e for e in restored if "copies of step" in e["source"]]
    assert "re-sharded in memory from 2 ranks (read parts [], rank to rank from [0, 1]" in copied["source"], copied
    assert copied["received_bytes"] > 0, copied  # the lost rank's shards came from its buddy
    # The second lost rank is rank 1 again (the shrunk group's): its unpolled reports, up to its
    # fault, are completed from the plan.
    assert_exact_once(tmp_path / "runs" / j["run"]["name"] / "ledger.json", steps, BATCH, NUM_SAMPLES,
                      seed=SEED, lost_rank_upto=(1, second))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """From ranks forked without Ray (tests/spawn_ranks.py): the digests a cluster's run ends with."""
    return uninterrupted_digests(hsdp_job(tmp_path_factory.mktemp("base")))


def test_an_hsdp_straggler_is_swapped_for_a_spare_from_the_other_group(cluster, baseline, tmp_path):  # noqa: F811
    """Rank 1 computes 3x slower from step 4, inside its forward and backward: its shard peer
    (rank 0) waits for it inside its own all-gathers and reduce-scatters, so by the wall clock
    both look slow; by CPU time (elastic/runtime/compute_clock.py) only rank 1 does. It is swapped
    for the warm spare, which takes shard 1 from rank 3's memory; the run ends bit-identical."""
    cluster.ensure_worker_nodes(5)
    j = hsdp_job(tmp_path, [{"action": "slow", "rank": 1, "at_step": 4, "factor": 3}], num_spares=1,
                 wait_for_spares=True)
    j["stragglers"] = {"enabled": True, "window_steps": 4, "consecutive_windows": 2, "cooldown_s": 60}
    result = Trainer(j).fit(progress=False)
    assert result.digests == baseline
    (swap,) = [d for d in result.events_of("decision") if d["decision"] == "Swap"]
    assert swap["ranks"] == [1], swap
    assert not [d for d in result.events_of("decision") if d["decision"] in ("Drop", "Restart")]
    (swapped,) = result.events_of("swapped")
    assert swapped["rank"] == 1 and swapped["how"] == "warm spare", swapped
    restored = result.events_of("restored")[-1]
    assert restored["uri"] is None and restored["source"].startswith("slot replicas"), restored
    assert_exact_once(tmp_path / "runs" / j["run"]["name"] / "ledger.json", NUM_STEPS, BATCH, NUM_SAMPLES,
                      seed=SEED)


def test_hsdp_node_kill_restores_from_the_other_group(cluster, baseline, tmp_path):  # noqa: F811
    """With a warm spare (its model built for no shard yet: it builds shard 1's). A replacement
    started on demand restores the same way (DDP's and the pipeline's drills take that path)."""
    cluster.ensure_worker_nodes(5)
    how = "warm spare"
    j = hsdp_job(tmp_path, [{"action": "kill_node", "rank": 1, "at_step": FAULT_STEP}],
                 num_spares=1, wait_for_spares=True)
    result = Trainer(j).fit(progress=False)
    assert result.digests == baseline
    assert not result.events_of("buddies")  # replica groups hold each other's copies: none taken
    (rec,) = result.events_of("recovered")
    assert rec["lost_steps"] == 0 and rec["resumed_step"] >= FAULT_STEP, rec
    assert result.events_of("workers_replaced")[0]["how"] == {"1": how}
    _assert_from_the_other_group(result, tmp_path, j)
