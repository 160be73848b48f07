"""In-memory copies of sharded state (checkpoint.memory_every_steps): who keeps whose copy, which
copies a restore can use (pure), and what a rank keeps (elastic/runtime/memory_copies.py)."""
from __future__ import annotations

import pytest

from elastic.policies.buddies import choose_buddies, choose_copies
from elastic.runtime.memory_copies import MemoryCopies


def test_one_rank_per_node_makes_a_ring_across_nodes():
    pairs, alone = choose_buddies({0: "a", 1: "b", 2: "c"})
    assert pairs == {0: 1, 1: 2, 2: 0} and alone == []


def test_losing_any_one_node_never_loses_a_part_with_its_copy():
    nodes = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    pairs, alone = choose_buddies(nodes)
    assert not alone and all(nodes[r] != nodes[b] for r, b in pairs.items())
    # A node's two ranks copy to two different nodes, and nobody holds more than one copy more than another.
    assert all(nodes[pairs[r]] != nodes[pairs[r + 1]] for r in (0, 2, 4))
    held = [list(pairs.values()).count(r) for r in nodes]
    assert max(held) - min(held) <= 1
    for lost in "abc":
        gone = {r for r, n in nodes.items() if n == lost}
        assert all(pairs[r] not in gone for r in gone)


def test_ranks_that_share_their_node_with_everyone_have_no_buddy():
    assert choose_buddies({0: "a", 1: "a"}) == ({}, [0, 1])
    pairs, alone = choose_buddies({0: "a", 1: "a", 2: "b"})
    assert pairs == {0: 2, 1: 2, 2: 0} and alone == []


def test_the_newest_step_every_part_survived_at_is_chosen():
    # Rank 1 lost; its buddy 2 got its copy of step 7 but not yet of step 8.
    own = {0: (7, 8), 2: (7, 8)}
    held = {0: {2: (7, 8)}, 2: {1: (7,)}}
    (step, sources), why, _ = choose_copies(3, own, held)
    assert step == 7 and sources == {0: 0, 1: 2, 2: 2}
    assert "rank 1 from rank 2" in why and "no storage read" in why
    # Step 8 reached the buddy too: nothing redone.
    (step, _), _, _ = choose_copies(3, own, {0: {2: (7, 8)}, 2: {1: (7, 8)}})
    assert step == 8


def test_a_rank_lost_with_its_buddy_falls_back_to_storage():
    # Ranks 1 and 2 lost together; rank 2 held rank 1's copy.
    found, why, lost = choose_copies(3, {0: (7, 8)}, {0: {2: (7, 8)}})
    assert found is None and lost and "none of ranks [1]" in why
    found, why, lost = choose_copies(3, {}, {})
    assert found is None and lost and "no in-memory copies yet" in why


def test_a_buddy_keeps_two_parts_per_rank_and_drops_older_groups():
    c = MemoryCopies(1)
    c.start(3, None)
    for step in (4, 5, 6):
        assert c.hold(1, 3, {"step": step, "part": 1})
    assert c.report() == ((), {1: (5, 6)})
    assert c.part(1, 6, own=False)["step"] == 6
    assert not c.hold(1, 2, {"step": 7})  # a late send from an older group
    # A send of the next group may arrive before this rank's own run() starts it: kept.
    assert c.hold(2, 4, {"step": 9})
    c.start(4, None)
    assert c.report() == ((), {2: (9,)})
    c.clear()
    assert c.report() == ((), {})


def test_copies_are_taken_where_state_is_held_once():
    from elastic.policies.buddies import has_copies
    assert has_copies(1, sharded=True, pp=1, dp=3, tp=1)  # FSDP
    assert has_copies(1, sharded=False, pp=3, dp=1, tp=1)  # a pipeline with one replica
    assert not has_copies(1, sharded=False, pp=1, dp=3, tp=1)  # DDP: the replicas are the copies
    assert not has_copies(1, sharded=False, pp=2, dp=2, tp=1)  # a replicated pipeline
    assert has_copies(1, sharded=True, pp=1, dp=2, tp=2)  # FSDP x TP: 2-D shards
    assert has_copies(1, sharded=False, pp=3, dp=1, tp=2)  # a one-replica pipeline's tensor slices
    assert not has_copies(0, sharded=True, pp=1, dp=3, tp=1)  # turned off
    assert has_copies(1, sharded=False, pp=1, dp=1, tp=1, shards=2)  # HSDP shrunk to one replica group
    assert has_copies(1, sharded=False, pp=1, dp=1, tp=2, shards=2)  # the same with tensor slices
    assert not has_copies(1, sharded=False, pp=1, dp=2, tp=1, shards=2)  # HSDP: the other group is the copy


def test_a_shrink_keeps_a_restore_from_copies():
    from elastic.parallel.shape import Shape
    from elastic.parallel.topology import Layout
    from elastic.policies.restore import FromShards, restore_after_shrink
    plan = FromShards({0: "a", 1: "b", 2: "c"}, 3, 14, old_pp=3)
    shape = Shape(stages=3, staged=True)
    got = restore_after_shrink(shape, plan, Layout(3, 1), {0: 0, 2: 1}, Layout(2, 1), {0: 15, 2: 15}, True)
    assert got == plan


def test_copies_are_spaced_to_stay_within_their_budget():
    c = MemoryCopies(1, max_overhead=0.05)
    for _ in range(3):
        assert c.holding_back(10, 0.1)  # the step time without a copy is measured first
        c.note_step(0.1)
    assert not c.holding_back(10, 0.1)  # nothing measured yet: the first copy is taken
    c.last_step, c.cost_s = 10, 0.02  # a copy at step 10 cost 20 ms; a step takes 100 ms
    # 20 ms is 5 % of 4 steps: steps 11..13 hold back, the copy after step 14 goes.
    assert [c.holding_back(s, 0.1) for s in (10, 11, 12, 13)] == [True, True, True, False]
    c = MemoryCopies(1, max_overhead=1.0)
    for _ in range(3):
        c.note_step(0.1)
    c.last_step, c.cost_s = 10, 0.02
    assert not c.holding_back(10, 0.1)  # a budget of 100 %: every step memory_every_steps allows


def test_a_copys_cost_is_its_take_and_the_slowdown_of_steps_during_its_send():
    import threading
    c = MemoryCopies(1, max_overhead=0.05)
    for t in (0.10, 0.11, 0.09, 0.10, 0.30):  # a slow outlier does not move the median
        c.note_step(t)
    release = threading.Event()
    c._sender = threading.Thread(target=release.wait)
    c.generation = c._sender_gen = 1  # a send of this group's (an older group's holds nothing back)
    c._sender.start()
    c.cost_s, c._extra_s = 0.01, 0.0  # what take() leaves: 10 ms on the training thread
    c.note_step(0.16)  # a step while the send is on its way: 60 ms beyond the median of 100 ms
    assert c.holding_back(11, 0.1) and c.cost_s == 0.01  # still on its way: not counted yet
    release.set()
    c._sender.join()
    c.note_step(0.12)  # the send ended during this step: 20 ms more, and the cost is complete
    assert abs(c.cost_s - 0.09) < 1e-9 and c._extra_s is None
    c.note_step(0.5)  # then steps join the baseline again
    assert len(c._base) == 6


def test_a_committed_checkpoint_newer_than_the_copies_wins():
    own, held = {0: (7,), 2: (7,)}, {0: {2: (7,)}, 2: {1: (7,)}}
    found, why, lost = choose_copies(3, own, held, committed_step=10)
    assert found is None and not lost and "older than the latest committed checkpoint (step 10)" in why
    (step, _), _, _ = choose_copies(3, own, held, committed_step=5)
    assert step == 7


# ---------------------------------------------------------------- the host-memory budget (pure)
def test_copies_that_pass_a_nodes_memory_budget_are_refused_naming_the_node():
    from elastic.policies.buddies import NodeRoom, copies_room
    gib = 2 ** 30
    nodes = [NodeRoom("a", 1, 8 * gib), NodeRoom("b", 4, 8 * gib)]
    # 1 GiB of state over 4 ranks: 256 MiB a rank, 4 copies each -> 1 GiB per rank on a node.
    assert copies_room(gib / 4, 4, nodes, 0.5) is None  # node b: 4 GiB of 8, within half
    why = copies_room(gib / 4, 4, nodes, 0.25)
    assert why.startswith("in-memory copies need about 4.00 GiB on node b (4 rank(s) x 4 x 256 MiB"), why
    assert copies_room(gib / 2, 2, [NodeRoom("c", 8, 8 * gib)], 0.5) is None  # only 2 ranks to hold


def test_the_state_estimate_counts_the_optimizers_moments_from_a_meta_build():
    import torch
    from elastic import workload
    from elastic.parallel.memory import state_bytes
    from tests.support.workloads import build_smooth_model
    n = sum(p.numel() for p in workload.build_model().parameters())
    assert state_bytes(workload.build_model, workload.build_optimizer) == 3 * 4 * n  # fp32 + AdamW's 2 moments
    assert state_bytes(build_smooth_model, workload.build_sgd) == 2 * 4 * n  # + SGD's momentum
    assert state_bytes(workload.build_model, lambda p: torch.optim.SGD(p, lr=0.1)) == 4 * n  # no state


def test_which_jobs_take_copies_and_at_what_world_size(tmp_path):
    from elastic.config import JobConfig
    from elastic.group.room import copies_world
    base = {"run": {"name": "x", "num_steps": 4}, "checkpoint": {"storage_uri": f"file://{tmp_path}"},
            "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                      "loss": "elastic.workload:loss_fn", "global_batch_size": 48, "strategy": "fsdp"}}
    def world(scaling, **train):
        j = {**base, "scaling": scaling, "train": {**base["train"], **train}}
        return copies_world(JobConfig.model_validate(j))
    assert world({"num_workers": 3}) == 3
    assert world({"num_workers": 4, "min_workers": 2}) == 2  # the largest share: at the smallest world
    assert world({"num_workers": 4}, fsdp={"replicate": 2}) is None  # the other group is the copy
    # ... until the run shrinks to one group, where HSDP's shards are held once.
    assert world({"num_workers": 4, "min_workers": 2}, fsdp={"replicate": 2}) == 2
    assert world({"num_workers": 4}, strategy="ddp") is None


def test_a_copy_is_its_steps_checkpoint_snapshot_and_restores_bit_exact(tmp_path):
    """memory_sync's copy of a checkpoint step is that checkpoint's snapshot (no staging copy of
    the same bytes): saved from it, FSDP's model and AdamW state load back bit for bit; the
    copy's memory is not reused for a later copy while the persist reads it."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastic.checkpoint.dcp_io import save_shards
    from elastic.parallel.resharding import flatten, offer
    from elastic.runtime.memory_copies import as_snapshot

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        torch.manual_seed(0)

        def build():
            m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
            fully_shard(m, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
            return m, torch.optim.AdamW(m.parameters(), lr=0.1)
        model, opt = build()
        model(torch.randn(3, 8)).square().sum().backward()
        opt.step()
        model_sd, optim_sd = get_state_dict(model, opt)
        tree = {"model": model_sd, "optim": optim_sd}
        part = offer(tree, 0, 1, 1)
        snap = as_snapshot(tree, part)
        assert snap is not None  # AdamW's betas (a tuple) and plain values pass through
        shard = snap["model"]["0.weight"]
        rows = part["sharded"][("model", "0.weight")]
        assert shard.to_local().data_ptr() == rows.data_ptr()  # no copy
        expected = {p: v.to_local().clone() if hasattr(v, "to_local") else v
                    for p, v in flatten(tree)}
        save_shards(snap, f"file://{tmp_path}/ckpt", {}, None)
        model2, opt2 = build()
        model2(torch.randn(3, 8)).sum().backward()
        opt2.step()  # AdamW's state made, other values than the saved ones
        back_model, back_optim = get_state_dict(model2, opt2)
        back = {"model": back_model, "optim": back_optim}
        dcp.load(back, checkpoint_id=str(tmp_path / "ckpt"))
        for p, v in flatten(back):
            want = expected[p]
            got = v.to_local() if hasattr(v, "to_local") else v
            assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, p
    finally:
        dist.destroy_process_group()


def test_a_copy_a_persist_reads_is_not_reused_for_the_next():
    class Ckpt:
        reading = None

        def reads(self, owner):
            return owner is not None and owner is self.reading
    c = MemoryCopies(every_steps=1, sync=True)
    c.own = {1: {"step": 1}, 2: {"step": 2}}
    ckpt = Ckpt()
    ckpt.reading = c.own[1]
    assert c._evict_oldest(c.own, ckpt) is None  # its memory left alone ...
    assert list(c.own) == [2]  # ... and dropped from the parts kept
    c.own[3] = {"step": 3}
    assert c._evict_oldest(c.own, ckpt) == {"step": 2}  # not read: reused


@pytest.mark.timeout(300)
def test_a_checkpoint_saved_from_the_steps_copy_restores_the_run_bit_exact(tmp_path):
    """FSDP on 2 real ranks with memory_sync and a checkpoint every step: each checkpoint is saved
    from the step's in-memory copy (no staging copy), and a restore from the last one holds the
    state the run ended with, bit for bit."""
    from tests.spawn_ranks import run_ranks
    from tests.test_tensor_parallel import gpt_job
    job = gpt_job(tmp_path, "fsdp", workers=2, tp=1, steps=3, name="share", meta_init=True)
    job["checkpoint"].update(every_steps=1, memory_every_steps=1, memory_sync=True)
    ran = run_ranks(job, ring=True, env={"GPT_LAYERS": "2", "GPT_DIM": "64"})
    assert all(o[6]["snapshot_is_the_copy"] is True for o in ran), [o[6] for o in ran]
    last = sorted((tmp_path / "share" / "checkpoints").glob("step_*"))[-1]
    assert last.name.endswith("3")
    back = run_ranks(job, candidates=[f"file://{last}"], steps=3,
                     env={"GPT_LAYERS": "2", "GPT_DIM": "64"})
    assert all((o[4], o[5]) == ("storage", 3) for o in back)
    assert [o[2] for o in back] == [o[2] for o in ran]
