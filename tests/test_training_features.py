"""Day-one training features on real Workers (gloo, one process per rank, no Ray): a learning-rate
schedule restored exactly through a checkpoint, global-norm clipping that agrees across DDP,
FSDP and pipeline stages, bf16 and fp16 autocast, and the bad-step policies."""
from __future__ import annotations

import math

import pytest
import torch

from elastic.config import ConfigError, parse_job
from tests.spawn_ranks import run_ranks

pytestmark = pytest.mark.timeout(300)


def mlp_job(tmp_path, workers=2, steps=12, strategy="ddp", **train):
    t = {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
         "loss": "elastic.workload:loss_fn", "global_batch_size": 16, "strategy": strategy, **train}
    return {"run": {"name": "f", "num_steps": steps, "seed": 3}, "scaling": {"num_workers": workers},
            "checkpoint": {"storage_uri": f"file://{tmp_path}", "every_steps": 6}, "train": t}


FEATURES = {"scheduler": "tests.support.faulty:warmup_cosine", "clip_grad_norm": 0.5, "precision": "bf16"}


def test_schedule_clipping_and_bf16_resume_bit_identical_from_a_checkpoint(tmp_path):
    whole = run_ranks(mlp_job(tmp_path / "a", **FEATURES))
    run_ranks(mlp_job(tmp_path / "b", **FEATURES), steps=6)  # stopped at its step-6 checkpoint
    resumed = run_ranks(mlp_job(tmp_path / "c", **FEATURES), candidates=[f"file://{tmp_path}/b/f/checkpoints/step_000000006"])
    assert resumed[0][4] == "storage" and resumed[0][5] == 6
    assert [o[2] for o in resumed] == [o[2] for o in whole]  # model and optimizer state, bit for bit
    assert resumed[0][6]["lr"] == whole[0][6]["lr"]  # the schedule replayed to the same step
    # The schedule moved the learning rate (warmup then cosine), and clipping was active.
    plain = run_ranks(mlp_job(tmp_path / "d", scheduler=FEATURES["scheduler"]))
    assert whole[0][6]["lr"] != 1e-3 and plain[0][2] != whole[0][2]


def _one_step(tmp_path, name, strategy, workers, pp=1, **extra):
    j = mlp_job(tmp_path / name, workers=workers, steps=1, strategy=strategy, clip_grad_norm=1e9, **extra)
    return run_ranks(j, pp=pp)


def test_the_global_gradient_norm_is_the_same_under_ddp_fsdp_and_pipeline_stages(tmp_path):
    """The norm clipping uses covers every parameter once: replicas hold copies, FSDP ranks parts,
    pipeline stages different layers."""
    from elastic.workload import build_dataset, build_model, loss_fn
    from elastic.data.order import GlobalOrder
    from torch.utils.data import default_collate
    torch.manual_seed(3)
    model = build_model()
    ds = build_dataset()
    idx = GlobalOrder(len(ds), 3).indices(0, 16)
    loss_fn(model, default_collate([ds[i] for i in idx])).backward()
    want = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    ddp = _one_step(tmp_path, "ddp", "ddp", 2)
    fsdp = _one_step(tmp_path, "fsdp", "fsdp", 2)
    pipe = run_ranks({**mlp_job(tmp_path / "pp", workers=2, steps=1, strategy="pipeline", clip_grad_norm=1e9),
                      "train": {**mlp_job(tmp_path, strategy="pipeline")["train"], "loss": None, "clip_grad_norm": 1e9,
                                "pipeline": {"stages": 2, "microbatches": 2,
                                             "loss": "tests.test_training_features:mlp_stage_loss"}}}, pp=2)
    for out in (ddp, fsdp, pipe):
        norms = {o[6]["grad_norm"] for o in out}
        assert len(norms) == 1  # every rank agrees
        assert norms.pop() == pytest.approx(want, rel=1e-5)


def mlp_stage_loss(logits, target):
    return torch.nn.functional.cross_entropy(logits, target)


def test_fp16_loss_scale_is_saved_and_restored(tmp_path):
    whole = run_ranks(mlp_job(tmp_path / "a", precision="fp16"))
    run_ranks(mlp_job(tmp_path / "b", precision="fp16"), steps=6)
    resumed = run_ranks(mlp_job(tmp_path / "c", precision="fp16"),
                        candidates=[f"file://{tmp_path}/b/f/checkpoints/step_000000006"])
    assert [o[2] for o in resumed] == [o[2] for o in whole]
    assert all(math.isfinite(o[3]) for o in whole)


POISON = {"dataset": "tests.support.faulty:poisoned_dataset", "loss": "tests.support.faulty:poisoned_loss"}


def _poisoned_steps(n: int, steps: int) -> tuple[str, list[int]]:
    """Sample ids that poison steps 3 and 4 (1-based: the 3rd and 4th steps) of the data order."""
    from elastic.data.order import GlobalOrder
    from elastic.workload import NUM_SAMPLES
    order = GlobalOrder(NUM_SAMPLES, 3)
    ids = [order.indices(s * 16, s * 16 + 1)[0] for s in (2, 3)][:n]
    return ",".join(map(str, ids)), [3, 4][:n]


def test_bad_step_raise_names_the_step(tmp_path):
    ids, steps = _poisoned_steps(1, 12)
    out = run_ranks(mlp_job(tmp_path, **POISON), env={"ELASTIC_POISONED_SAMPLES": ids}, expect="bad_step")
    assert all("step 3: non-finite loss on some rank (train.bad_step=raise)" in o[2] for o in out)


def test_bad_step_skip_skips_the_update_on_every_rank_together(tmp_path):
    ids, steps = _poisoned_steps(2, 12)
    out = run_ranks(mlp_job(tmp_path, bad_step="skip", **POISON), env={"ELASTIC_POISONED_SAMPLES": ids})
    for o in out:  # both ranks skipped steps 3 and 4 (only rank 0's samples were poisoned)
        assert [s for s, _ in o[6]["skipped"]] == steps and math.isfinite(o[3])
    assert out[0][2] == out[1][2]
    # A limit of 2 bad steps in a row ends the run with an error that says so.
    out = run_ranks(mlp_job(tmp_path / "x", bad_step="skip", bad_step_limit=2, **POISON),
                    env={"ELASTIC_POISONED_SAMPLES": ids}, expect="bad_step")
    assert "2 bad steps in a row" in out[0][2]


def test_feature_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="clip_grad_norm"):
        parse_job(mlp_job(tmp_path, clip_grad_norm=0))
    with pytest.raises(ConfigError, match="precision"):
        parse_job(mlp_job(tmp_path, precision="fp8"))
    from elastic import Trainer
    with pytest.raises(ConfigError, match="train.scheduler.*ReduceLROnPlateau"):
        Trainer(mlp_job(tmp_path, scheduler="tests.test_training_features:plateau"))


def plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def test_prefetch_and_gradient_accumulation_change_nothing_but_timing(tmp_path):
    """train.prefetch collates the next step's micro-batches on a thread: the same samples in the
    same order, so the same bits; with micro-batches, only the last one's backward all-reduces."""
    plain = run_ranks(mlp_job(tmp_path / "a", micro_batch_size=4))
    ahead = run_ranks(mlp_job(tmp_path / "b", micro_batch_size=4, prefetch=True))
    assert [o[2] for o in ahead] == [o[2] for o in plain] and plain[0][2] == plain[1][2]
    # Data workers (processes, in the same global order) as well: the same bits.
    workers = run_ranks(mlp_job(tmp_path / "c", micro_batch_size=4, data_workers=2))
    assert [o[2] for o in workers] == [o[2] for o in plain]
