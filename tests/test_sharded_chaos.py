"""Sharded state (FSDP) recovered from memory: each rank's part copied to a rank on another node
every step (checkpoint.memory_every_steps=1, memory_max_overhead=1: no spacing for their cost), on a real local cluster (head + 4 one-CPU nodes).

A node killed between checkpoints takes a rank and its shards; the group takes the survivors' own
parts and the lost rank's copy from its buddy, re-shards them into the new group (a new worker,
or a warm spare), and goes on with no storage read. With checkpoint.memory_sync no step is
redone: the drills slow the lost rank's link to its buddy (1 s a copy, from two steps before the
kill), so a copy sent in the background would still be on its way when the node dies and the
step before it would be redone; a step reported done has its copies in. The run ends
bit-identical to an uninterrupted one, and every sample is seen once. (Background copies' "at
most one step redone" is the HSDP and pipeline drills'.)"""
from __future__ import annotations

import uuid

import pytest

from elastic import Trainer
from elastic.workload import NUM_SAMPLES
from tests.ray_fixtures import assert_exact_once, cluster, ray_cluster  # noqa: F401 - pytest fixtures
from tests.spawn_ranks import uninterrupted_digests

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

NUM_STEPS, EVERY, FAULT_STEP, BATCH, SEED = 30, 10, 15, 48, 7


def fsdp_job(tmp_path, chaos=(), **scaling) -> dict:
    return {
        "run": {"name": f"s-{uuid.uuid4().hex[:8]}", "num_steps": NUM_STEPS, "seed": SEED, "sample_ledger": True},
        "scaling": {"num_workers": 3, **scaling},
        "failure": {"max_failures": 2, "hang_floor_s": 5},
        "checkpoint": {"storage_uri": str(tmp_path / "runs"), "every_steps": EVERY, "memory_every_steps": 1,
                       "memory_max_overhead": 1.0},  # a copy every step, whatever it costs here
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": BATCH, "strategy": "fsdp"},
        "chaos": [dict(c) for c in chaos],
    }


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """From ranks forked without Ray (tests/spawn_ranks.py): the digests a cluster's run ends with."""
    return uninterrupted_digests(fsdp_job(tmp_path_factory.mktemp("base")))


def _assert_from_memory(result, baseline, tmp_path, j):
    assert result.digests == baseline
    pairs = result.events_of("buddies")[0]  # the first group's
    assert sorted(pairs["buddies"].values()) == [0, 1, 2] and not pairs["alone"]
    (plan,) = result.events_of("restore_plan")
    assert plan["source"] == "FromShards" and "no storage read" in plan["reason"], plan
    assert "rank 1 from rank" in plan["reason"], plan
    restored = result.events_of("restored")[-1]
    assert restored["uri"] is None and restored["source"].startswith("re-sharded in memory"), restored
    # Every part from a member's memory, rank to rank (nothing read through the object store).
    assert "(read parts [], rank to rank from [0, 1, 2], copies of step" in restored["source"], restored
    assert restored["received_bytes"] > 0 and restored["transfer_gb_per_s"] > 0, restored  # the lost part, sent
    (rec,) = result.events_of("recovered")
    assert rec["resumed_step"] == FAULT_STEP and rec["lost_steps"] == 0, rec  # memory_sync: nothing redone
    assert_exact_once(tmp_path / "runs" / j["run"]["name"] / "ledger.json", NUM_STEPS, BATCH, NUM_SAMPLES,
                      seed=SEED, lost_rank_upto=(1, FAULT_STEP))


# The lost rank's copies reach its buddy 1 s late from two steps before its node is killed.
KILL = [{"action": "slow_copies", "rank": 1, "at_step": FAULT_STEP - 2, "delay_s": 1.0},
        {"action": "kill_node", "rank": 1, "at_step": FAULT_STEP}]


def _synced(j: dict) -> dict:
    j["checkpoint"]["memory_sync"] = True
    return j


def test_fsdp_node_kill_restores_from_in_memory_copies(cluster, baseline, tmp_path):  # noqa: F811
    j = _synced(fsdp_job(tmp_path, KILL))
    result = Trainer(j).fit(progress=False)
    _assert_from_memory(result, baseline, tmp_path, j)
    assert result.events_of("workers_replaced")[0]["how"] == {"1": "started on demand"}


def test_fsdp_node_kill_with_a_warm_spare_restores_from_in_memory_copies(cluster, baseline, tmp_path):  # noqa: F811
    j = _synced(fsdp_job(tmp_path, KILL, num_spares=1, wait_for_spares=True))
    j["train"]["fsdp"] = {"offload": True}  # CPU offload's shards through the copies too: the same state, bit for bit
    result = Trainer(j).fit(progress=False)
    _assert_from_memory(result, baseline, tmp_path, j)
    assert result.events_of("workers_replaced")[0]["how"] == {"1": "warm spare"}


def test_copies_over_the_host_memory_budget_are_refused_before_any_worker_starts(cluster, tmp_path):  # noqa: F811
    from elastic.config import ConfigError
    j = fsdp_job(tmp_path)
    j["checkpoint"]["memory_max_host_share"] = 1e-6  # of each node's memory: far below 4 x a rank's share
    trainer = Trainer(j)
    with pytest.raises(ConfigError, match=r"checkpoint.memory_max_host_share=1e-06: in-memory copies need about "
                                          r"[\d.]+ GiB on node .* \(1 rank\(s\) x 4 x 5 MiB"):
        trainer.fit(progress=False)
    assert not (tmp_path / "runs" / j["run"]["name"] / "events.jsonl").exists()  # no run started
