"""HSDP (train.fsdp.replicate): replica groups that each shard the state, the layout and restore
decisions it makes, the checks before any worker starts, and real gloo ranks (spawned processes,
no Ray) training it against plain FSDP and moving checkpoints between the two."""
from __future__ import annotations

import glob
import math

import pytest

from elastic.config import JobConfig
from elastic.parallel.shape import shape_for
from elastic.parallel.topology import Layout, chain
from elastic.policies.restore import FromPeer, choose_restore, restore_after_shrink
from elastic.config import FailureConfig
from tests.spawn_ranks import run_ranks
from tests.test_tensor_parallel import REL, gpt_job


def hsdp_job(tmp_path, workers=4, replicate=2, name="hsdp", **over) -> dict:
    job = gpt_job(tmp_path, "fsdp", workers=workers, tp=1, name=name)
    job["train"]["fsdp"] = {"replicate": replicate}
    for k, v in over.items():
        job.setdefault(k, {}).update(v)
    return job


# ---------------------------------------------------------------- layout and decisions (pure)
def test_each_shard_of_a_replica_group_reads_its_own_share_of_the_batch():
    lay = Layout(1, 2, 1, 2)  # 2 replica groups x 2 shards
    assert lay.world_size == 4 and lay.slots == 2 and lay.data_world == 4
    assert [lay.slot_of(r) for r in range(4)] == [0, 1, 0, 1]  # rank 2 holds what rank 0 holds
    assert [lay.data_rank(r) for r in range(4)] == [0, 1, 2, 3]  # but reads other samples
    assert [lay.stage_of(r) for r in range(4)] == [0] * 4
    assert chain(Layout(1, 3, 1, 2), 2) == [Layout(1, 3, 1, 2), Layout(1, 2, 1, 2), Layout(1, 1, 1, 2)]


def test_a_lost_rank_is_restored_from_its_peer_at_the_same_shard(tmp_path):
    shape = shape_for(JobConfig.model_validate(hsdp_job(tmp_path)))
    assert shape.staged and not shape.sharded and shape.unit == 2 and shape.layout(4) == Layout(1, 2, 1, 2)
    lay = shape.layout(4)
    plan, why = choose_restore({0: 9, 2: 9, 3: 9}, FailureConfig(), shape.sharded, lay)  # rank 1 lost
    assert plan == FromPeer(0, 9, (0, 3)) and "no storage read" in why and "shard (HSDP)" in why
    # Without a replacement: one group of 2 is left, each survivor keeps its shard (0 and 3 -> 0, 1).
    new, mapping = shape.shrink(shape.layout(4), lay, [0, 2, 3], 2)
    assert new == Layout(1, 1, 1, 2) and {new.slot_of(v) for v in mapping.values()} == {0, 1}
    after = restore_after_shrink(shape, plan, lay, mapping, new, {0: 9, 2: 9, 3: 9}, True)
    assert isinstance(after, FromPeer) and after.step == 9
    assert all(lay.slot_of(old) == new.slot_of(mapping[old]) for old in mapping if mapping[old] in after.slot_sources)
    # Both holders of one shard lost: no group holds it in memory.
    plan, why = choose_restore({0: 9, 2: 9}, FailureConfig(), shape.sharded, lay)
    assert plan.__class__.__name__ == "FromStorage" and "held: [0] of 2" in why
    # The run grows by whole groups only.
    assert shape.grow(Layout(1, 2, 1, 2), Layout(1, 1, 1, 2), 1) is None
    assert shape.grow(Layout(1, 2, 1, 2), Layout(1, 1, 1, 2), 2) == Layout(1, 2, 1, 2)
    assert shape.offer_keepers([0, 1, 2, 3], None) is None  # a planned change copies from a group


@pytest.mark.parametrize("over, match", [
    ({"train": {"fsdp": {"replicate": 3}}}, r"train.fsdp.replicate=3 does not divide scaling.num_workers=4"),
    ({"train": {"fsdp": {"replicate": 4}}}, r"replicate=4 leaves one shard per group"),
    ({"train": {"tp": {"size": 2}}}, r"train.fsdp.replicate=2 leaves one shard per group .* train.tp.size"),
    ({"scaling": {"min_workers": 3}}, r"scaling.min_workers=3 is not a multiple of the HSDP group size 2"),
    ({"train": {"strategy": "ddp"}}, r"train.fsdp is set but train.strategy=ddp"),
])
def test_bad_hsdp_layouts_are_refused_naming_the_field(tmp_path, over, match):
    job = hsdp_job(tmp_path)
    for section, fields in over.items():
        for k, v in fields.items():
            sec = job.setdefault(section, {})
            sec[k] = {**sec[k], **v} if isinstance(v, dict) and isinstance(sec.get(k), dict) else v
    with pytest.raises(ValueError, match=match):
        JobConfig.model_validate(job)


# ---------------------------------------------------------------- real ranks (gloo, spawned)
@pytest.mark.timeout(600)
def test_hsdp_trains_like_plain_fsdp_and_its_groups_agree_bit_for_bit(tmp_path):
    """The same global batch, split over 4 data ranks either way: HSDP 2 x 2 reduce-scatters in a
    group and all-reduces across groups, FSDP 4 reduce-scatters over all four. The loss and the
    gradient norm agree to REL (float32 sums in another order; a share read twice or a gradient
    averaged over 2 instead of 4 is far outside it). Every rank's digest is of the whole state."""
    base = run_ranks(gpt_job(tmp_path, "fsdp", workers=4, tp=1, name="flat"))
    out = run_ranks(hsdp_job(tmp_path))
    assert math.isclose(out[0][3], base[0][3], rel_tol=REL), (out[0][3], base[0][3])
    assert math.isclose(out[0][6]["grad_norm"], base[0][6]["grad_norm"], rel_tol=REL)
    assert len({o[2] for o in out}) == 1  # one state, whichever rank digests it
    assert out[0][6]["mesh"] == ("dp", "shard") and out[0][6]["placements"] == "(Replicate(), Shard(dim=0))"
    assert base[0][6]["placements"] == "(Shard(dim=0),)"


@pytest.mark.timeout(600)
def test_an_hsdp_checkpoint_loads_bit_identical_as_plain_fsdp_and_back(tmp_path):
    src = run_ranks(hsdp_job(tmp_path, name="src"))
    step6 = sorted(glob.glob(f"{tmp_path}/src/checkpoints/step_*"))[-1]
    # Into plain FSDP over 2 (no replica axis, other shards); and a plain FSDP checkpoint into HSDP.
    out = run_ranks(gpt_job(tmp_path, "fsdp", workers=2, tp=1, name="src"), candidates=[f"file://{step6}"], steps=6)
    assert {(o[4][:7], o[5]) for o in out} == {("storage", 6)}
    assert {o[2] for o in out} == {src[0][2]}
    flat = run_ranks(gpt_job(tmp_path, "fsdp", workers=2, tp=1, name="flat"))
    step6 = sorted(glob.glob(f"{tmp_path}/flat/checkpoints/step_*"))[-1]
    out = run_ranks(hsdp_job(tmp_path, name="flat"), candidates=[f"file://{step6}"], steps=6)
    assert {(o[4][:7], o[5]) for o in out} == {("storage", 6)}
    assert {o[2] for o in out} == {flat[0][2]}


# ---------------------------------------------------------------- HSDP x tensor parallelism
def test_hsdp_x_tp_layout_is_whole_groups_of_shards_x_tp(tmp_path):
    """2 replica groups x 2 shards x 2 tp ranks: a slot is (shard, tp index); a lost rank is
    restored from the rank at its slot in the other group; the run grows by whole groups of 4."""
    job = JobConfig.model_validate(hsdp_tp_job(tmp_path, "h3"))
    assert job.hsdp_shards == 2
    shape = shape_for(job)
    assert shape.staged and not shape.sharded and shape.unit == 4
    lay = shape.layout(8)
    assert lay == Layout(1, 2, 2, 2) and lay.data_world == 4
    assert [lay.slot_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [lay.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # tp ranks read the same samples
    plan, why = choose_restore({r: 7 for r in range(8) if r != 5}, FailureConfig(), shape.sharded, lay)
    assert plan == FromPeer(0, 7, (0, 1, 2, 3)) and "shard x tensor slice" in why
    with pytest.raises(ValueError, match=r"scaling.min_workers=2 is not a multiple of the HSDP group size 4"):
        JobConfig.model_validate({**hsdp_tp_job(tmp_path, "h3"), "scaling": {"num_workers": 8, "min_workers": 2}})


# 8 ranks on 2 cores: one block of examples/gpt.py (still split over tp and sharded, with its
# embedding and head) keeps a step to what the checks need.
ONE_BLOCK = {"GPT_LAYERS": "1"}


def hsdp_tp_job(tmp_path, name):
    job = gpt_job(tmp_path, "fsdp", workers=8, tp=2, name=name)
    job["train"]["fsdp"] = {"replicate": 2}
    return job


@pytest.mark.timeout(900)
def test_hsdp_x_tp_trains_like_the_model_without_tp_recovers_from_a_replica_and_loads_elsewhere(tmp_path):
    """8 ranks on a ("dp", "shard", "tp") mesh: FSDP2 over the first two axes (replicated over
    "dp") of parameters tensor-parallel over "tp".
    - The loss and gradient norm match plain FSDP over 2 ranks to REL; every rank digests one state.
    - After step 3 group 1's four ranks are replaced by workers with nothing built; the group forms
      again and each copies its (shard, tp) slot from group 0's rank at the same slot, rank to
      rank, no storage read. Trained on to step 6 they end bit-identical to the uninterrupted run.
    - Its checkpoint loads bit-identical into FSDP x TP over 4 ranks (no replica axis)."""
    base = run_ranks(gpt_job(tmp_path, "fsdp", workers=2, tp=1, name="flat"), env=ONE_BLOCK)
    out = run_ranks(hsdp_tp_job(tmp_path, "h3"), env=ONE_BLOCK)
    assert math.isclose(out[0][3], base[0][3], rel_tol=REL), (out[0][3], base[0][3])
    assert math.isclose(out[0][6]["grad_norm"], base[0][6]["grad_norm"], rel_tol=REL)
    assert len({o[2] for o in out}) == 1
    assert out[0][6]["mesh"] == ("dp", "shard", "tp")
    again = run_ranks(hsdp_tp_job(tmp_path, "again"), peer_sources=[0, 1, 2, 3], peer_at=3, env=ONE_BLOCK)
    assert {(o[4], o[5]) for o in again} == {("slot replicas [0, 1, 2, 3]", 3)}
    assert {o[2] for o in again} == {out[0][2]}
    step6 = sorted(glob.glob(f"{tmp_path}/h3/checkpoints/step_*"))[-1]
    ftp = run_ranks(gpt_job(tmp_path, "fsdp", workers=4, tp=2, name="h3"), candidates=[f"file://{step6}"], steps=6,
                    env=ONE_BLOCK)
    assert {(o[4][:7], o[5]) for o in ftp} == {("storage", 6)}
    assert {o[2] for o in ftp} == {out[0][2]}
