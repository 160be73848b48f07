"""CPU offload for FSDP (train.fsdp.offload, FSDP2's CPUOffloadPolicy): refused where it is not
built, applied to every FSDP unit, and exact on a fresh run and through a restore from storage at
another layout (real gloo ranks, spawned). On these CPU-only machines the shards live in host
memory either way, so what is shown is the wiring and the recovery path, not the memory saved on
a GPU (docs/large-models.md)."""
from __future__ import annotations

import pytest

from elastic.config import JobConfig
from tests.spawn_ranks import run_ranks
from tests.test_tensor_parallel import gpt_job


@pytest.mark.parametrize("over, match", [
    ({"precision": "fp16"}, r"train.fsdp.offload with train.precision: fp16 is not built"),
    ({"meta_init": True}, r"train.fsdp.offload with train.meta_init is not built yet"),
    ({"strategy": "ddp"}, r"train.fsdp is set but train.strategy=ddp"),
])
def test_offload_is_refused_where_it_is_not_built(tmp_path, over, match):
    job = gpt_job(tmp_path, over.pop("strategy", "fsdp"), workers=2, tp=1, fsdp={"offload": True}, **over)
    with pytest.raises(ValueError, match=match):
        JobConfig.model_validate(job)


def offload_policies(model) -> set[str]:
    """The offload policy of every FSDP unit of `model` (by class name)."""
    out = set()
    for m in model.modules():
        get = getattr(m, "_get_fsdp_state", None)
        group = get()._fsdp_param_group if get else None  # FSDP2's own record of the unit's policy
        if group is not None:
            out.add(type(group.offload_policy).__name__)
    return out


@pytest.mark.timeout(600)
def test_offload_trains_and_restores_bit_identical(tmp_path):
    probe = "tests.test_offload:offload_policies"
    plain = run_ranks(gpt_job(tmp_path, "fsdp", workers=2, tp=1, name="plain"), probe=probe)
    off = run_ranks(gpt_job(tmp_path, "fsdp", workers=2, tp=1, name="off", fsdp={"offload": True}), probe=probe)
    assert {o[6]["probe"] for o in off} == {frozenset({"CPUOffloadPolicy"})}
    assert {o[6]["probe"] for o in plain} == {frozenset({"OffloadPolicy"})}
    assert {o[2] for o in off} == {o[2] for o in plain} and len({o[2] for o in off}) == 1
    # A checkpoint written without offload loads into an offloaded model at another world size and
    # tp layout, and the state is the saved one, bit for bit.
    step6 = sorted((tmp_path / "plain" / "checkpoints").glob("step_*"))[-1]
    out = run_ranks(gpt_job(tmp_path, "fsdp", workers=4, tp=2, name="plain", fsdp={"offload": True}),
                    candidates=[f"file://{step6}"], steps=6)
    assert {(o[4], o[5]) for o in out} == {("storage", 6)}
    assert {o[2] for o in out} == {plain[0][2]}
