"""Tensor parallelism surviving faults, on a real local multi-node Ray cluster (head + 5 one-CPU
nodes; a rank takes half a CPU, as examples/gpt_3d.yaml asks, so each tp group of 2 starts on one
node, and the fifth node has room for a lost node's replacements).

* examples/gpt_3d.yaml, dp 2 x pp 2 x tp 2 = 8 ranks: the node of rank 0 killed mid-run takes
  the whole tp group of stage 0 of replica 0 with it; the replacements copy that slot from
  replica 1's memory (no storage read, no step redone), and the run ends bit-identical, rank by
  rank, to an uninterrupted one.
* ddp x tp (dp 2 x tp 2 = 4 ranks), rank 0's node killed with replacements too slow to wait for
  (scaling.shrink_after_s 1 s): the group shrinks to the one replica left, every tp slot from a
  survivor that holds it (a replacement that joined without state never takes a holder's slot),
  then grows back to 2 replicas when the replacements are warm; the survivors' DTensors are
  re-bound to each new mesh, the replicas end equal and every sample is seen once. (At 8 ranks,
  dp x pp x tp, this drill took 55 to 94 s of a 2-core machine; the slots along pp are the
  pipeline drills' business.)
* pp 2 x tp 2 with one replica (a copy every step with checkpoint.memory_sync), rank 0's node
  killed: stage 0's tp group comes back from its copies at the buddies, no storage read, no step
  redone, bit-identical.
* fsdp x tp (2-D shards, a copy every step with checkpoint.memory_sync, the lost group's copies
  slowed before the fault), rank 0's node killed with replacements too slow to wait for: no
  survivor holds the lost tp group's shards, but their copies at the buddies on another node do.
  The group shrinks to one replica at the fault's step (none redone), each tp slice re-sharded
  over dp from the copies (no storage read), then grows back with every kept part moved rank to
  rank; every sample is seen once. (The fixed-layout restore from copies ending bit-identical is test_sharded_chaos's;
  the 2-D re-shard's exactness is test_resharding's.)
* ddp x tp with a warm spare, rank 1's process killed: the replacement starts on its tp group's
  node (the dead process's slot) rather than take the spare on another node; bit-identical.
* fsdp x tp without spares (issue 55): the node of tp group 1 killed with three free nodes of
  room, then rank 1's process: every replacement beside its group, read from the events' node
  ids (the worker started at a fault's first signal once took a rank elsewhere, 2 of 2 runs).
"""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from elastic import Trainer
from elastic.local_cluster import local_cluster
from tests.ray_fixtures import assert_exact_once
from tests.spawn_ranks import uninterrupted_digests

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

NUM_STEPS, EVERY, FAULT_STEP, BATCH = 14, 5, 9, 32  # 5 steps after the fault, between checkpoints
SHRINK_STEPS = 40  # room to train at 4 ranks again after the grow
NODES = 5


@pytest.fixture(scope="module")
def ray_cluster():
    with local_cluster(num_worker_nodes=NODES, cpus_per_node=1, dashboard=False) as c:
        yield c


@pytest.fixture
def cluster(ray_cluster):
    ray_cluster.ensure_worker_nodes(NODES)
    # Placement reads free CPUs per node: the last test's actors must have given theirs back, or
    # a tp group may start split (and a node kill then takes a slot from both replicas).
    ray_cluster.wait_quiet()
    return ray_cluster


def gpt_3d(tmp_path, chaos=(), steps=NUM_STEPS, **train) -> dict:
    j = yaml.safe_load((Path(__file__).parents[1] / "examples" / "gpt_3d.yaml").read_text())
    j["run"].update(name=f"g3d-{uuid.uuid4().hex[:8]}", num_steps=steps, sample_ledger=True)
    j["checkpoint"].update(storage_uri=str(tmp_path / "runs"), every_steps=EVERY)
    j["failure"]["hang_floor_s"] = 10
    j["train"].update(train)
    j["chaos"] = [dict(c) for c in chaos]
    return j


@pytest.fixture(scope="module")
def baseline_3d(tmp_path_factory):
    """From ranks forked without Ray (tests/spawn_ranks.py): the digests a cluster's run ends with."""
    d = uninterrupted_digests(gpt_3d(tmp_path_factory.mktemp("b3d")))
    assert all(d[r] == d[r % 4] for r in range(8))  # replicas of a slot agree
    assert len({d[r] for r in range(4)}) == 2  # a stage's state is one digest (gathered over tp)
    return d


def test_node_kill_in_3d_copies_the_lost_tp_group_from_the_other_replica(cluster, baseline_3d, tmp_path):
    j = gpt_3d(tmp_path, [{"action": "kill_node", "rank": 0, "at_step": FAULT_STEP}])
    j["scaling"]["shrink_after_s"] = 120  # wait for the replacements (their start takes seconds here)
    result = Trainer(j).fit(progress=False)
    assert result.digests == baseline_3d
    placed = result.events_of("placement")[0]  # the first start's
    assert placed["split_groups"] == [], placed
    (rep,) = result.events_of("workers_replaced")  # the lost tp group's two ranks: together on a free node
    assert rep["tp_split_groups"] == [] and rep["nodes"]["0"] == rep["nodes"]["1"], rep
    (plan,) = result.events_of("restore_plan")
    assert plan["source"] == "FromPeer" and "no storage read" in plan["reason"], plan
    restored = result.events_of("restored")[-1]
    # Slots 0 and 1 (stage 0's tp ranks) from replica 1's ranks 4 and 5; stage 1 keeps its own.
    assert restored["uri"] is None and restored["source"] == "slot replicas [4, 5, 2, 3]", restored
    (rec,) = result.events_of("recovered")
    assert rec["resumed_step"] == FAULT_STEP and rec["lost_steps"] == 0
    assert_exact_once(tmp_path / "runs" / j["run"]["name"] / "ledger.json", NUM_STEPS, BATCH,
                      _num_samples(), seed=0, lost_rank_upto=(0, FAULT_STEP))  # replica 0's unpolled steps


def test_one_replica_pipeline_x_tp_node_kill_restores_the_lost_tp_group_from_memory_copies(cluster, tmp_path):
    """pp 2 x tp 2 with one replica: the lost node held stage 0's whole tp group, and no replica
    exists; the copies of its two slices at their buddies on another node bring it back, each
    slice to the replacement at its own tp index, with no storage read, bit-identical."""
    def one_replica(chaos=()):
        j = gpt_3d(tmp_path / f"r{len(chaos)}", chaos)
        j["scaling"].update(num_workers=4, min_workers=4)
        j["checkpoint"].update(memory_every_steps=1, memory_sync=True)  # a copy every step, in before it is reported
        return j
    base = uninterrupted_digests(one_replica())
    j = one_replica([{"action": "kill_node", "rank": 0, "at_step": FAULT_STEP}])
    result = Trainer(j).fit(progress=False)
    assert result.digests == base
    (plan,) = result.events_of("restore_plan")
    assert plan["source"] == "FromShards", (plan, result.events_of("buddies"))
    restored = result.events_of("restored")[-1]
    assert restored["uri"] is None and "in memory" in restored["source"], restored
    (rec,) = result.events_of("recovered")
    assert rec["lost_steps"] == 0 and rec["resumed_step"] == FAULT_STEP, rec  # memory_sync: nothing redone
    assert_exact_once(tmp_path / "r1" / "runs" / j["run"]["name"] / "ledger.json", NUM_STEPS, BATCH,
                      _num_samples(), seed=0, lost_rank_upto=(0, FAULT_STEP))


def test_ddp_tp_shrinks_to_one_replica_from_memory_and_grows_back(cluster, tmp_path):
    j = gpt_3d(tmp_path, [{"action": "kill_node", "rank": 0, "at_step": FAULT_STEP}], steps=SHRINK_STEPS,
               strategy="ddp", pipeline=None, loss="tests.support.workloads:gpt_loss_slower_below_4_ranks")
    j["scaling"].update(num_workers=4, min_workers=2, shrink_after_s=1, grow_check_s=1)
    result = Trainer(j).fit(progress=False)
    assert result.metrics["step"] == SHRINK_STEPS
    # The premise: each tp group started on one node, so the node kill takes one whole replica.
    assert result.events_of("placement")[0]["split_groups"] == [], _recovery_story(result)
    resized = result.events_of("resized")
    assert [(r["old_world_size"], r["new_world_size"], r["path"]) for r in resized] == [(4, 2, "memory"),
                                                                                        (2, 4, "memory")], \
        _recovery_story(result)
    d = result.digests
    assert all(d[r] == d[r % 2] for r in range(4))  # the replicas of every tp slot end equal
    assert_exact_once(tmp_path / "runs" / j["run"]["name"] / "ledger.json", SHRINK_STEPS, BATCH, _num_samples(),
                      seed=0, lost_rank_upto=(0, FAULT_STEP))


def test_fsdp_tp_node_kill_shrinks_and_grows_back_from_memory_copies(cluster, tmp_path):
    # The lost tp group's copies reach their buddies 1 s late from two steps before its node is
    # killed; with memory_sync every reported step's copies are in all the same.
    slow = [{"action": "slow_copies", "rank": r, "at_step": FAULT_STEP - 2, "delay_s": 1.0} for r in (0, 1)]
    j = gpt_3d(tmp_path, [*slow, {"action": "kill_node", "rank": 0, "at_step": FAULT_STEP}], steps=SHRINK_STEPS,
               strategy="fsdp", pipeline=None, loss="tests.support.workloads:gpt_loss_slower_below_4_ranks")
    j["scaling"].update(num_workers=4, min_workers=2, shrink_after_s=1, grow_check_s=1)
    j["checkpoint"].update(memory_every_steps=1, memory_sync=True)  # a copy every step, in before it is reported
    result = Trainer(j).fit(progress=False)
    assert result.metrics["step"] == SHRINK_STEPS
    done = result.events_of("resize_completed")
    assert done[0]["lost_steps"] == 0 and done[0]["resumed_step"] == FAULT_STEP, done  # nothing redone
    (plan,) = result.events_of("restore_plan")
    assert plan["source"] == "FromShards", (plan, result.events_of("buddies"))
    resized = result.events_of("resized")
    assert [(r["old_world_size"], r["new_world_size"], r["path"]) for r in resized] == [(4, 2, "memory"),
                                                                                        (2, 4, "memory")], \
        _recovery_story(result)
    restored = result.events_of("restored")[1:]  # after the first start's
    assert [e["uri"] for e in restored] == [None, None], restored  # no storage read, either way
    assert "re-sharded in memory from 4 ranks" in restored[0]["source"], restored
    assert "rank to rank" in restored[1]["source"], restored  # the grow: kept parts sent over the group
    assert_exact_once(tmp_path / "runs" / j["run"]["name"] / "ledger.json", SHRINK_STEPS, BATCH, _num_samples(),
                      seed=0, lost_rank_upto=(0, FAULT_STEP))


def test_a_replacement_starts_beside_its_tp_group_rather_than_take_a_spare_elsewhere(cluster, tmp_path):
    """ddp x tp, rank 1's process killed, a warm spare on another node: its tp group's node has
    the dead process's slot, so the replacement starts there (taking the spare would put every
    tensor-parallel collective of the group across nodes for the rest of the run). The slot comes
    from the other replica's memory, and the run ends bit-identical to an uninterrupted one."""
    def ddp_tp(chaos=()):
        j = gpt_3d(tmp_path / f"r{len(chaos)}", chaos, strategy="ddp", pipeline=None, loss="examples.gpt:loss_fn")
        j["scaling"].update(num_workers=4, min_workers=4, num_spares=1, wait_for_spares=True)
        return j
    base = uninterrupted_digests(ddp_tp())
    j = ddp_tp([{"action": "kill_process", "rank": 1, "at_step": FAULT_STEP}])
    result = Trainer(j).fit(progress=False)
    assert result.digests == base
    started = result.events_of("workers_started")[0]["nodes"]
    assert result.events_of("placement")[0]["split_groups"] == [] and started["0"] == started["1"], started
    fault_t = result.events_of("failure_detected")[0]["t"]
    spare_nodes = {e["node"][:12] for e in result.events_of("spare_ready") if e["t"] < fault_t}
    assert spare_nodes and started["0"] not in spare_nodes, (spare_nodes, started)  # the warm spare is elsewhere
    (rep,) = result.events_of("workers_replaced")
    assert rep["how"] == {"1": "started on demand"} and rep["nodes"]["1"] == started["0"], rep
    assert rep["tp_split_groups"] == [], rep
    (plan,) = result.events_of("restore_plan")
    assert plan["source"] == "FromPeer" and "no storage read" in plan["reason"], plan


def test_every_replacement_of_a_tp_rank_goes_beside_its_group(cluster, tmp_path):
    """fsdp x tp (dp 2 x tp 2), no spares, a copy every step. The node holding tp group 1 (ranks 2
    and 3) is killed while three nodes have room for both: the two replacements start on one of
    them. Then rank 1's process is killed: its replacement starts in the slot it left, beside
    rank 0. Both restore from the in-memory copies, and no recovery leaves a group split."""
    steps = 16
    chaos = [{"action": "kill_node", "rank": 2, "at_step": 5}, {"action": "kill_process", "rank": 1, "at_step": 11}]
    j = gpt_3d(tmp_path, chaos, steps=steps, strategy="fsdp", pipeline=None, loss="examples.gpt:loss_fn")
    j["scaling"].update(num_workers=4, min_workers=4)
    j["checkpoint"].update(memory_every_steps=1, memory_sync=True)
    result = Trainer(j).fit(progress=False)
    story = _recovery_story(result)
    assert result.metrics["step"] == steps, story
    nodes = dict(result.events_of("workers_started")[0]["nodes"])
    assert result.events_of("placement")[0]["split_groups"] == [], story  # the premise: each group on one node
    replaced = result.events_of("workers_replaced")
    assert [r["ranks"] for r in replaced] == [[2, 3], [1]], story
    killed_node = nodes["2"]
    for rep in replaced:
        nodes.update(rep["nodes"])
        assert rep["tp_split_groups"] == [], story
        # From the node ids: every replaced rank shares its node with every rank of its tp group.
        assert all(nodes[str(r)] == nodes[str(r // 2 * 2 + i)] for r in rep["ranks"] for i in range(2)), story
    assert replaced[0]["nodes"]["2"] != killed_node, story  # on a node that lives
    assert replaced[1]["nodes"]["1"] == nodes["0"], story  # the slot its dead process left, beside rank 0
    assert result.events_of("tp_split") == [], story
    assert [p["source"] for p in result.events_of("restore_plan")] == ["FromShards"] * 2, story
    assert all(e["uri"] is None for e in result.events_of("restored")[1:]), story  # no storage read


@pytest.mark.parametrize("strategy", [
    # CI simulation at 26428a1 (2026-12-08): after the Swap of rank 1 the group hung for 121 s
    # and every rank was restarted. Not reproduced or explained yet: the race db7d455 fixed is
    # not the whole story. Kept running (not strict) so a pass still shows; the fsdp variant
    # passed in the same run.
    pytest.param("ddp", marks=pytest.mark.xfail(strict=False, reason="a swap that sometimes hangs "
                                                "the tp regroup (CI simulation at 26428a1)")),
    "fsdp"])
def test_a_tp_straggler_is_swapped_not_its_tp_peer_and_its_group_is_gathered_again(cluster, tmp_path, strategy):
    """dp 2 x tp 2, rank 1 computes 3x slower from step 3, inside its forward and backward: its tp
    peer (rank 0) waits for it in every layer's all-reduce, so by the wall clock both are slow.
    By CPU time (elastic/runtime/compute_clock.py) only rank 1 is, and it alone is swapped for the
    warm spare: the slot comes from the other replica's memory (ddp x tp) or is re-sharded from the
    parts offered at the stop (fsdp x tp). The only spare is on another node, so tp group 0 spans
    two nodes; the pool's refill starts beside rank 0, in the straggler's freed slot, and once it
    is warm and calibrated fast, rank 1 moves to it (train.tp.regroup). The run ends bit-identical
    to an uninterrupted one."""
    steps = 60  # room for the refill to warm at low priority and the regroup after it
    def job(chaos=()):
        loss = "examples.gpt:loss_fn"
        # Not meta_init: a spare then holds no values to time its compute with (it is never weighed).
        j = gpt_3d(tmp_path / f"r{len(chaos)}", chaos, steps=steps, strategy=strategy, pipeline=None, loss=loss,
                   meta_init=False)
        j["scaling"].update(num_workers=4, min_workers=4, num_spares=1, wait_for_spares=True)
        j["stragglers"] = {"enabled": True, "window_steps": 4, "consecutive_windows": 2, "cooldown_s": 60}
        return j
    base = uninterrupted_digests(job())
    j = job([{"action": "slow", "rank": 1, "at_step": 3, "factor": 3}])
    result = Trainer(j).fit(progress=False)
    assert result.digests == base
    acts = [d for d in result.events_of("decision") if d["decision"] in ("Swap", "Drop", "Report", "Restart",
                                                                          "Regroup")]
    assert [(d["decision"], d["ranks"]) for d in acts] == [("Swap", [1]), ("Regroup", [1])], acts
    swapped, regrouped = result.events_of("swapped")
    assert swapped["rank"] == 1 and swapped["how"] == "warm spare" and not swapped["regroup"], swapped
    # The only spare is on another node (rank 1's tp peer fills the rest of its node): the group
    # now spans two nodes, and the event says so.
    assert swapped["tp_split_groups"] == [0] and swapped["new_node"] != swapped["old_node"], swapped
    # Gathered again: rank 1 leaves the spare's node for the refill beside rank 0.
    assert regrouped["regroup"] and regrouped["how"] == "warm spare", regrouped
    assert regrouped["old_node"] == swapped["new_node"] and regrouped["tp_split_groups"] == [], regrouped
    assert all(e["uri"] is None for e in result.events_of("restored")), result.events_of("restored")
    assert_exact_once(tmp_path / "r1" / "runs" / j["run"]["name"] / "ledger.json", steps, BATCH, _num_samples(),
                      seed=0)


def _num_samples() -> int:
    from examples.gpt import build_dataset
    return len(build_dataset())


def _recovery_story(result) -> list:
    """The events that say how a fault was handled, for a failed assertion's message."""
    kinds = {"placement", "workers_started", "failure_detected", "decision", "worker_replaced",
             "collectives_aborted", "slow_return", "restore_plan", "workers_replaced", "resized", "recovered",
             "faults_merged", "group_error", "tp_split", "spare_ready", "spare_lost"}
    return [{k: v for k, v in e.items() if k not in ("ts", "run")} for e in result.events if e["kind"] in kinds]
