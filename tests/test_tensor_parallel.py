"""Tensor parallelism (train.tp): the (dp, pp, tp) layout, the restore decisions it makes, the
checks before any worker starts, and real gloo ranks (spawned processes, no Ray) training every
combination and moving checkpoints between layouts."""
from __future__ import annotations

import glob
import math

import pytest
import torch
from torch import nn

from elastic.config import JobConfig
from elastic.parallel.shape import Shape
from elastic.parallel.strategies import STRATEGIES
from elastic.parallel.tensor import TensorPlanError, builtin_plans, check_builtin
from elastic.parallel.topology import Layout, chain, reassign, slot_sources
from elastic.policies.restore import FromPeer, FromShards, FromStorage, choose_restore, planned_restore, restore_after_shrink
from tests.spawn_ranks import run_ranks


def gpt_job(tmp_path, strategy="ddp", workers=4, tp=2, stages=None, steps=6, name="tp", **train):
    t = {"model": "examples.gpt:build_model", "dataset": "examples.gpt:build_dataset",
         "optimizer": "examples.gpt:build_optimizer", "global_batch_size": 16, "strategy": strategy,
         "tp": {"size": tp}, "clip_grad_norm": 1.0, **train}
    if strategy == "pipeline":
        t["pipeline"] = {"stages": stages, "microbatches": 2, "loss": "examples.gpt:stage_loss"}
    else:
        t["loss"] = "examples.gpt:loss_fn"
    return {"run": {"name": name, "num_steps": steps, "seed": 0}, "scaling": {"num_workers": workers},
            "checkpoint": {"storage_uri": f"file://{tmp_path}", "every_steps": 3}, "train": t}


def checked(job: dict) -> JobConfig:
    """What the driver does before any worker starts: validate, then the strategy's model check."""
    jc = JobConfig.model_validate(job)
    STRATEGIES[jc.train.strategy].check_job(jc, jc.train.resolve()["model"])
    return jc


# ---------------------------------------------------------------- the layout (pure)
def test_layout_numbers_ranks_replica_then_stage_then_tp():
    lay = Layout(pp=2, dp=2, tp=2)
    assert lay.world_size == 8 and lay.slots == 4
    assert [lay.replica_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [lay.tp_of(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [lay.slot_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    # tp never changes along the chain: whole replicas, then stages.
    assert chain(Layout(2, 2, 2)) == [Layout(2, 2, 2), Layout(2, 1, 2), Layout(1, 1, 2)]


def test_a_lost_tp_rank_is_restored_from_the_replica_of_its_slot():
    lay = Layout(1, 2, 2)  # ranks 0,1 | 2,3
    plan, why = choose_restore({0: 7, 2: 7, 3: 7}, _failure(), layout=lay)  # rank 1 lost
    assert plan == FromPeer(0, 7, (0, 3)) and "slot" in why
    # Both ranks of slot 1 lost: no replica holds it, so storage.
    plan, why = choose_restore({0: 7, 2: 7}, _failure(), layout=lay)
    assert isinstance(plan, FromStorage) and "held: [0] of 2" in why
    # A shrink keeps each survivor on its slot: replica 1's rank 3 becomes slot 1 of the one replica left.
    mapping = reassign(lay, [0, 2, 3], Layout(1, 1, 2))
    assert mapping == {0: 0, 3: 1}
    assert slot_sources(lay, mapping, Layout(1, 1, 2), {0: 7, 2: 7, 3: 7}) == (0, 1)
    shape = Shape(tp=2)
    assert shape.staged and shape.unit == 2 and shape.layout(6) == Layout(1, 3, 2)
    got = restore_after_shrink(shape, FromPeer(0, 7, (0, 3)), lay, mapping, Layout(1, 1, 2), {0: 7, 2: 7, 3: 7}, True)
    assert got == FromPeer(0, 7, (0, 1))


def test_planned_changes_copy_slots_from_a_replica_other_than_the_swapped_rank():
    shape, lay = Shape(tp=2), Layout(1, 2, 2)
    assert planned_restore(shape, True, 5, {}, 4, old_layout=lay, new_layout=Layout(1, 3, 2)) == FromPeer(0, 5, (0, 1))
    assert planned_restore(shape, True, 5, {}, 4, old_layout=lay, new_layout=lay, swapped=1) == FromPeer(0, 5, (0, 3))
    # FSDP x TP: every rank's 2-D shards are re-sharded in memory (each tp slice over dp); the
    # ranks that stay keep theirs (and their numbers, so their tp index), the leaving one publishes.
    fsdp_tp = Shape(sharded=True, tp=2)
    assert fsdp_tp.offer_keepers([0, 1, 2, 3], None) == {0, 1, 2, 3}
    assert fsdp_tp.offer_keepers([0, 1, 2, 3], 1) == {0, 2, 3}
    assert planned_restore(fsdp_tp, True, 5, {}, 4, old_layout=lay, new_layout=Layout(1, 1, 2)) == FromShards({}, 4, 5)
    assert planned_restore(fsdp_tp, False, 5, {}, 4, old_layout=lay, new_layout=lay) == FromStorage()


def _failure():
    from elastic.config import FailureConfig
    return FailureConfig()


# ---------------------------------------------------------------- checks before any worker starts
def test_built_in_plan_splits_attention_and_mlp_of_the_example():
    from examples.gpt import build_model
    with torch.device("meta"):
        model = build_model()
    plans = builtin_plans(model)
    assert sorted(plans) == ["1", "2", "3", "4"]  # the four blocks, not the embedding or the head
    assert plans["1"] == {"qkv": "colwise", "proj": "rowwise", "mlp.0": "colwise", "mlp.2": "rowwise"}
    check_builtin(model, 2)
    with pytest.raises(TensorPlanError, match=r"train.tp.size=3 does not divide the 4 attention heads"):
        check_builtin(model, 3)
    with pytest.raises(TensorPlanError, match="found no block to split"):
        check_builtin(nn.Sequential(nn.Linear(4, 4)), 2)
    check_builtin(model, 2, sequence_parallel=True)
    # Sequence parallelism splits each block's own norms, between blocks that follow one another.
    no_norms = nn.Sequential(_Attn())
    with pytest.raises(TensorPlanError, match=r"train.tp.sequence_parallel: the block 0 holds no LayerNorm"):
        check_builtin(no_norms, 2, sequence_parallel=True)
    check_builtin(no_norms, 2)
    nested = _Attn()
    nested.ln, nested.inner = nn.LayerNorm(8), _Attn()
    with pytest.raises(TensorPlanError, match=r"found the block inner inside the block \(root\)"):
        check_builtin(nested, 2, sequence_parallel=True)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)


@pytest.mark.parametrize("over, match", [
    ({"scaling": {"num_workers": 6}}, r"scaling.num_workers=6 is not a multiple of train.tp.size=4"),
    ({"scaling": {"num_workers": 8, "min_workers": 6}}, r"scaling.min_workers=6 is not a multiple"),
    ({"train": {"tp": {"size": 1, "plan": "examples.gpt:build_model"}}}, r"train.tp.plan is set but train.tp.size is 1"),
    ({"train": {"tp": {"size": 1, "sequence_parallel": True}}}, r"train.tp.sequence_parallel is set but train.tp.size is 1"),
    ({"train": {"tp": {"size": 4, "sequence_parallel": True, "plan": "examples.gpt:build_model"}}},
     r"train.tp.sequence_parallel applies to the built-in plan, and train.tp.plan is set"),
])
def test_bad_tp_layouts_are_refused_naming_the_field(tmp_path, over, match):
    job = gpt_job(tmp_path, workers=8, tp=4)
    for k, v in over.items():
        job[k] = {**job.get(k, {}), **v}
    with pytest.raises(ValueError, match=match):
        JobConfig.model_validate(job)


def test_straggler_swaps_are_allowed_with_tp_but_not_in_a_pipeline(tmp_path):
    for strategy in ("ddp", "fsdp"):
        job = gpt_job(tmp_path, strategy=strategy)
        job["stragglers"] = {"enabled": True}
        JobConfig.model_validate(job)
    job = gpt_job(tmp_path, strategy="pipeline", stages=2)
    job["stragglers"] = {"enabled": True}
    with pytest.raises(ValueError, match=r"straggler swaps are not built for pipelines"):
        JobConfig.model_validate(job)


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_before_any_worker(tmp_path):
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        checked(gpt_job(tmp_path, workers=6, tp=3, global_batch_size=12))
    with pytest.raises(ValueError, match=r"a pipeline keeps its 2 stages"):
        JobConfig.model_validate({**gpt_job(tmp_path, "pipeline", workers=8, stages=2),
                                  "scaling": {"num_workers": 8, "min_workers": 2}})
    with pytest.raises(ValueError, match=r"train.activation_checkpointing=\['Nope'\]: no submodule of that class"):
        checked(gpt_job(tmp_path, activation_checkpointing=["Nope"]))
    checked(gpt_job(tmp_path, "fsdp", activation_checkpointing=["Block"]))


# ---------------------------------------------------------------- real ranks (gloo, spawned)
# Per quantity, from measurement: after 6 steps at dp 2 x tp 2 against dp 2 (examples/gpt.py,
# clipping on) the mean loss agreed to every printed digit and the gradient norm to 6.6e-8
# relative (float32 sums in another order). 1e-5 leaves two orders of magnitude for other
# machines' kernels while a wrong weighting (a loss counted once per tp rank: 2x; a replicated
# gradient counted twice: 1.39x) is far outside it.
REL = 1e-5


def _summary(out):
    return out[0][3], out[0][6]["grad_norm"]


@pytest.mark.timeout(600)
def test_every_combination_trains_like_the_same_model_without_tp(tmp_path):
    """With and without sequence parallelism (the norms and the residual stream split along the
    sequence inside the blocks): measured, it changed neither the loss nor the gradient norm
    beyond the same 6.6e-8 (DDP x TP and the pipeline without it are in the tests below too)."""
    base_loss, base_norm = _summary(run_ranks(gpt_job(tmp_path, workers=2, tp=1, name="base")))
    for strategy, workers, stages, sp in [("ddp", 4, None, True), ("fsdp", 4, None, True), ("pipeline", 4, 2, False),
                                          ("pipeline", 8, 2, True)]:
        job = gpt_job(tmp_path, strategy, workers=workers, stages=stages, name=f"{strategy}{workers}")
        job["train"]["tp"]["sequence_parallel"] = sp
        out = run_ranks(job, pp=stages or 1)
        loss, norm = _summary(out)
        assert math.isclose(loss, base_loss, rel_tol=REL), (strategy, workers, loss, base_loss)
        assert math.isclose(norm, base_norm, rel_tol=REL), (strategy, workers, norm, base_norm)
        # Replicas of a slot end bit-identical (the digest of a pipeline stage's state is its own).
        lay = Layout(stages or 1, workers // ((stages or 1) * 2), 2)
        for r in range(workers):
            assert out[r][2] == out[lay.slot_of(r)][2], (strategy, r)


def foreach_adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, foreach=True)


@pytest.mark.timeout(600)
def test_ddp_x_tp_gives_the_optimizer_plain_tensors_so_foreach_works(tmp_path):
    """torch's multi-tensor optimizers refuse a mix of DTensors and tensors; DDP x TP keeps its
    parameters plain outside forward (tensor.localize), as torch's DDP does, through activation
    checkpointing's recompute too."""
    opt = "tests.test_tensor_parallel:foreach_adamw"
    base_loss, base_norm = _summary(run_ranks(gpt_job(tmp_path, workers=2, tp=1, name="fe", optimizer=opt)))
    for strategy, stages in [("ddp", None), ("pipeline", 2)]:
        job = gpt_job(tmp_path, strategy, workers=4, stages=stages, name=f"fe{strategy}", optimizer=opt,
                      activation_checkpointing=["Block"])
        loss, norm = _summary(run_ranks(job, pp=stages or 1))
        assert math.isclose(loss, base_loss, rel_tol=REL), (strategy, loss, base_loss)
        assert math.isclose(norm, base_norm, rel_tol=REL), (strategy, norm, base_norm)


@pytest.mark.timeout(600)
def test_a_checkpoint_written_with_tp_loads_bit_identical_at_other_layouts(tmp_path):
    src = run_ranks(gpt_job(tmp_path, workers=4, tp=2, name="src"))
    step6 = sorted(glob.glob(f"{tmp_path}/src/checkpoints/step_*"))[-1]
    for strategy, workers, tp in [("ddp", 2, 1), ("fsdp", 2, 1), ("fsdp", 4, 2)]:
        job = gpt_job(tmp_path, strategy, workers=workers, tp=tp, name="src")
        job["train"]["tp"]["sequence_parallel"] = tp > 1  # norms as DTensors replicated over tp: the same names
        out = run_ranks(job, candidates=[f"file://{step6}"], steps=6)
        assert {(o[4][:7], o[5]) for o in out} == {("storage", 6)}
        assert {o[2] for o in out} == {src[0][2]}, (strategy, workers, tp)  # the whole state, bit for bit


# ---------------------------------------------------------------- placement (pure)
def test_tp_groups_start_on_one_node_each_spread_over_nodes():
    from elastic.policies.placement import place_tp_groups
    p = place_tp_groups(list(range(8)), 2, {"a": 2.0, "b": 2.0, "c": 2.0, "d": 2.0}, 0.5)
    assert [p.nodes[r] for r in range(8)] == ["a", "a", "b", "b", "c", "c", "d", "d"] and p.split == ()
    # One-CPU nodes cannot hold a group of 2 whole-CPU ranks: left to Ray, and said so.
    p = place_tp_groups([0, 1, 2, 3], 2, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, 1.0)
    assert set(p.nodes.values()) == {None} and p.split == (0, 2)
    assert "do not fit on one node" in p.reason(2)
    # Two groups on one node when only it has room; a third fits nowhere.
    p = place_tp_groups(list(range(6)), 2, {"a": 2.0, "b": 0.5}, 0.5)
    assert [p.nodes[r] for r in range(6)] == ["a", "a", "a", "a", None, None] and p.split == (4,)


@pytest.mark.timeout(600)
def test_activation_checkpointing_is_bit_identical(tmp_path):
    """The recompute replays the forward's RNG state and the same kernels: the same state, bit for
    bit, with and without it (measured also under pipeline dp 2 x pp 2 x tp 2, and without
    sequence parallelism)."""
    digests = []
    for ac in (None, ["Block"]):
        job = gpt_job(tmp_path, "fsdp", workers=4, name=f"ac{bool(ac)}", activation_checkpointing=ac)
        job["train"]["tp"]["sequence_parallel"] = True  # the recompute runs the norms' sequence hooks again
        out = run_ranks(job)
        digests.append({o[2] for o in out})
    assert digests[0] == digests[1] and len(digests[0]) == 1


def test_a_shrink_keeps_state_holders_on_their_slots_before_fresh_replacements():
    # dp 2 x pp 2 x tp 2; rank 0's replacement joined (no state), rank 1's never came: the one
    # replica left takes slot 0 from rank 4, which holds it, not from the fresh rank 0.
    old = Layout(2, 2, 2)
    new, mapping = Shape(stages=2, staged=True, tp=2).shrink(old, old, [0, 2, 3, 4, 5, 6, 7], 4,
                                                             holders=frozenset({2, 3, 4, 5, 6, 7}))
    assert new == Layout(2, 1, 2) and mapping == {4: 0, 5: 1, 2: 2, 3: 3}
    assert slot_sources(old, mapping, new, {r: 25 for r in (2, 3, 4, 5, 6, 7)}) == (0, 1, 2, 3)
    # Without the holders, rank 0 kept slot 0 and the state came from storage (seen in a drill).
    _, blind = Shape(stages=2, staged=True, tp=2).shrink(old, old, [0, 2, 3, 4, 5, 6, 7], 4)
    assert blind[0] == 0 and 4 not in blind


@pytest.mark.timeout(600)
def test_two_ranks_of_a_slot_trade_numbers_mid_run_and_end_bit_identical(tmp_path):
    """DDP x TP at dp 2 x tp 2: after step 3 ranks 0 and 2 (slot 0 of replicas 0 and 1) exchange
    numbers, as a trade does (elastic/controller/regroup.py): each forms the new group under the
    other's number with the state it holds and trains the other's share of the batch. Every rank
    ends bit-identical to the uninterrupted run (a rank that kept its old replica's samples would
    not: both replicas would train on the same half)."""
    base = run_ranks(gpt_job(tmp_path, name="whole"))
    out = run_ranks(gpt_job(tmp_path, name="traded"), peer_sources=[0, 1], peer_at=3, renumber={0: 2, 2: 0})
    assert [o[0] for o in out] == [0, 1, 2, 3]
    assert {(o[4], o[5]) for o in out} == {("slot replicas [0, 1]", 3)}
    assert [(o[2], o[3]) for o in out] == [(o[2], o[3]) for o in base]
