"""Pipeline stages without Ray: the split planner and the re-plan (pure functions), the job
checks, and real Workers (gloo, one process per rank) that train a pipeline and move its
checkpoint between 2 stages x 2 replicas, 4 stages, interleaved stages, DDP and FSDP."""
from __future__ import annotations

import pytest
from torch import nn

from elastic.config import ConfigError, parse_job
from elastic.parallel.pipeline import PlanError, balanced_bounds, chunks_of_stage, plan_chunks, stage_of_unit, units_of
from tests.spawn_ranks import run_ranks
from elastic.parallel.topology import Layout, chain, grow_to, reassign, shrink_to, slot_sources

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------- planner
def test_balanced_bounds_minimise_the_largest_stage():
    assert balanced_bounds([10, 10, 10, 10], 2) == [0, 2, 4]
    assert balanced_bounds([30, 1, 1, 1, 1, 30], 3) == [0, 1, 5, 6]
    assert balanced_bounds([5, 0, 5, 0, 5], 5) == [0, 1, 2, 3, 4, 5]  # every chunk non-empty
    with pytest.raises(PlanError):
        balanced_bounds([1, 2], 3)


def test_plan_follows_named_split_points_and_names_bad_ones():
    units = [(n, 1) for n in "abcdef"]
    assert plan_chunks(units, 3, ["c", "e"]) == [["a", "b"], ["c", "d"], ["e", "f"]]
    with pytest.raises(PlanError, match="not children"):
        plan_chunks(units, 2, ["x"])
    with pytest.raises(PlanError, match="in model order"):
        plan_chunks(units, 3, ["e", "c"])


def test_interleaved_chunks_and_where_each_unit_lives():
    assert chunks_of_stage(1, pp=2, per_rank=2) == [1, 3]
    chunks = [["a"], ["b"], ["c"], ["d"]]
    assert stage_of_unit(chunks, 2) == {"a": 0, "b": 1, "c": 0, "d": 1}


def test_units_need_a_sequential_root():
    with pytest.raises(PlanError, match="nn.Sequential"):
        units_of(nn.Linear(2, 2))
    assert units_of(nn.Sequential(nn.Linear(2, 3), nn.GELU())) == [("0", 9), ("1", 0)]


def test_layout_chain_drops_replicas_then_stages():
    top = Layout(3, 2)
    assert chain(top) == [Layout(3, 2), Layout(3, 1), Layout(2, 1), Layout(1, 1)]
    assert chain(top, min_world=2) == [Layout(3, 2), Layout(3, 1), Layout(2, 1)]
    assert shrink_to(top, 5, 2) == Layout(3, 1) and shrink_to(top, 1, 2) is None
    assert grow_to(top, Layout(2, 1), 1) == Layout(3, 1) and grow_to(top, Layout(3, 1), 2) is None
    assert grow_to(top, Layout(3, 1), 3) == Layout(3, 2)
    lay = Layout(3, 2)  # rank = replica x pp + stage
    assert [lay.stage_of(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]


def test_reassign_keeps_survivors_on_their_stage_and_finds_a_source_per_stage():
    old, new = Layout(2, 2), Layout(2, 1)
    mapping = reassign(old, [0, 2, 3], new)  # rank 1 (stage 1, replica 0) lost
    assert mapping == {0: 0, 3: 1}  # rank 3 (stage 1, replica 1) becomes stage 1 of the one replica left
    assert slot_sources(old, mapping, new, {0: 9, 2: 9, 3: 9}) == (0, 1)
    assert slot_sources(old, mapping, new, {0: 9, 2: 9, 3: 8}) is None  # stage 1 only held at an older step
    # Re-partitioned: no survivor keeps its stage's layers, so storage.
    mapping = reassign(Layout(3, 1), [0, 2], Layout(2, 1))
    assert mapping == {0: 0, 2: 1} and slot_sources(Layout(3, 1), mapping, Layout(2, 1), {0: 5, 2: 5}) is None


# ---------------------------------------------------------------- job checks
def gpt_job(tmp_path, strategy="pipeline", workers=4, stages=2, schedule="1f1b", steps=6, **pipeline):
    train = {"model": "examples.gpt:build_model", "dataset": "examples.gpt:build_dataset",
             "optimizer": "examples.gpt:build_optimizer", "global_batch_size": 16, "strategy": strategy}
    if strategy == "pipeline":
        train["pipeline"] = {"stages": stages, "microbatches": 4, "loss": "examples.gpt:stage_loss",
                             "schedule": schedule, **pipeline}
    else:
        train["loss"] = "examples.gpt:loss_fn"
    return {"run": {"name": "p", "num_steps": steps, "seed": 1}, "scaling": {"num_workers": workers},
            "checkpoint": {"storage_uri": f"file://{tmp_path}", "every_steps": 3}, "train": train}


@pytest.mark.parametrize("change, message", [
    ({"scaling": {"num_workers": 3}}, "not a multiple of train.pipeline.stages=2"),
    ({"pipeline": {"microbatches": 3}}, "does not split into 2 replica"),
    ({"pipeline": {"stages": 4, "microbatches": 2}, "scaling": {"num_workers": 4}}, "at least one micro-batch"),
    ({"pipeline": {"split": ["1", "2"]}}, "names 2 split points"),
    ({"pipeline": {"stages_per_rank": 2}}, "needs schedule: interleaved_1f1b"),
    ({"train": {"micro_batch_size": 2}}, "train.pipeline.microbatches"),
    ({"stragglers": {"enabled": True}}, "not built for pipelines"),
])
def test_pipeline_settings_are_checked_before_any_work(tmp_path, change, message):
    j = gpt_job(tmp_path)
    for k, v in change.items():
        if k == "pipeline":
            j["train"]["pipeline"].update(v)
        else:
            j[k] = {**j.get(k, {}), **v}
    with pytest.raises(ConfigError, match=message):
        parse_job(j)


def test_a_model_that_cannot_be_cut_is_refused_by_the_trainer(tmp_path):
    from elastic import Trainer
    j = gpt_job(tmp_path, workers=8, stages=8, microbatches=8)  # 6 units (embed, 4 blocks, head) < 8 stages
    with pytest.raises(ConfigError, match="cannot cut 6 units into 8"):
        Trainer(j)


# ---------------------------------------------------------------- real workers, gloo
def test_pipeline_trains_like_ddp_and_its_checkpoint_loads_in_every_layout(tmp_path):
    base = tmp_path / "pp"
    first = run_ranks(gpt_job(base), pp=2)
    # Replicas of a stage agree bit for bit; the two stages hold different layers.
    assert first[0][2] == first[2][2] and first[1][2] == first[3][2] and first[0][2] != first[1][2]
    ddp = run_ranks(gpt_job(tmp_path / "ddp", strategy="ddp", workers=2), pp=1)
    # The same model, data and optimizer as a plain data-parallel run; only the order of float
    # sums differs (micro-batches of 2 through the schedule vs one batch of 8 per rank).
    assert first[0][3] == pytest.approx(ddp[0][3], rel=1e-5)

    ckpt = f"file://{base}/p/checkpoints/step_000000006"
    losses = {}
    for label, job, pp in [
        ("ddp", gpt_job(tmp_path / "a", strategy="ddp", workers=2, steps=9), 1),
        ("fsdp", gpt_job(tmp_path / "b", strategy="fsdp", workers=2, steps=9), 1),
        ("4 stages", gpt_job(tmp_path / "c", stages=4, schedule="gpipe", steps=9), 4),
        ("2 stages x 2", gpt_job(tmp_path / "d", steps=9), 2),
        ("2 stages x 2 chunks", gpt_job(tmp_path / "e", stages=2, workers=2, schedule="interleaved_1f1b", steps=9), 2),
    ]:
        out = run_ranks(job, pp, [ckpt])
        assert all(o[4] == "storage" and o[5] == 6 for o in out), (label, out)
        losses[label] = out[-1][3]
    # Every layout resumed from the same state: the next steps' losses agree to float reordering.
    ref = losses["2 stages x 2"]
    assert all(x == pytest.approx(ref, rel=1e-5) for x in losses.values()), losses


def test_a_ddp_checkpoint_loads_into_stages(tmp_path):
    run_ranks(gpt_job(tmp_path / "ddp", strategy="ddp", workers=2), pp=1)
    out = run_ranks(gpt_job(tmp_path / "pp", stages=4, workers=4, schedule="gpipe", steps=8), 4,
                    [f"file://{tmp_path}/ddp/p/checkpoints/step_000000006"])
    assert all(o[4] == "storage" and o[5] == 6 for o in out)
